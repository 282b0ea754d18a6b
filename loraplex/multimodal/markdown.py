"""Images in native (LoRAX/TGI) `inputs`: markdown `![](URL)` or `![alt](URL)` -> placeholder + URLs.

LoRAX and TGI accept only `![](URL)`; alt text is accepted too since clients write it. The URL is
everything between the parentheses up to whitespace (data URLs hold no `(`, `)` or spaces; a web URL
that does must percent-encode them). Text around the images is left exactly as it was.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# Linear time: each run stops at the first ']' or '(' / ')' / space, so no start rescans another's text.
IMAGE = re.compile(r"!\[[^\]\n]*\]\(\s*([^()\s]+)\s*\)")


class TextWithImages(NamedTuple):
    text: str  # inputs with each image replaced by the placeholder
    urls: list[str]  # in the order they appeared


def split_markdown_images(inputs: str, placeholder: str) -> TextWithImages:
    """Replace each markdown image by `placeholder` (e.g. the model's "<image>") and collect its URL."""
    urls: list[str] = []

    def take(match: re.Match[str]) -> str:
        urls.append(match.group(1))
        return placeholder

    return TextWithImages(IMAGE.sub(take, inputs), urls)
