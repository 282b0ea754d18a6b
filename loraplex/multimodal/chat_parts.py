"""Images in OpenAI chat messages: content parts -> the shape vision chat templates read, plus URLs.

Hugging Face chat templates for vision models (llava-hf, LLaVA-NeXT, Llama 3.2 Vision) iterate
`message["content"]` as a list and emit the model's image token for each `{"type": "image"}` item
and the text of each `{"type": "text", "text": ...}` item. So each image part becomes
`{"type": "image"}` (its URL moves to the returned list, in order), and string content becomes one
text part, since some of those templates cannot iterate a plain string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from loraplex.multimodal.errors import InvalidMediaURL

IMAGE_PART = {"type": "image"}
DETAILS = ("auto", "low", "high")  # OpenAI's values; accepted and ignored (the processor decides)


class ChatWithImages(NamedTuple):
    messages: list[dict[str, Any]]  # copies; content is always a list of text/image parts
    urls: list[str]  # one per {"type": "image"} part, in conversation order


def split_chat_images(messages: Sequence[Mapping[str, Any]]) -> ChatWithImages:
    """Replace every image_url part by {"type": "image"}; return the messages and the URLs in order.

    Text parts are kept as they are, in place, so text around and between images is untouched.
    Raises InvalidMediaURL (400) for a malformed image part or a part type that is not text or image_url.
    """
    out, urls = [], []
    for i, message in enumerate(messages):
        message = _as_dict(message)
        content = message.get("content")
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                part = _as_dict(part)
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type")
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise InvalidMediaURL(f"{where}: a text part needs a string 'text'")
                    parts.append(part)
                elif kind == "image_url":
                    urls.append(_image_url(part.get("image_url"), where))
                    parts.append(dict(IMAGE_PART))
                else:
                    raise InvalidMediaURL(f"{where}: content parts of type {kind!r} are not supported (text, image_url)")
        else:
            raise InvalidMediaURL(f"messages[{i}].content must be a string or a list of parts")
        out.append({**message, "content": parts})
    return ChatWithImages(out, urls)


def _image_url(value: Any, where: str) -> str:
    """{"url": ..., "detail": ...}, or the bare string some clients send."""
    if isinstance(value, str):
        url = value
    elif isinstance(value, Mapping):
        url = value.get("url")
        detail = value.get("detail")
        if detail is not None and detail not in DETAILS:
            raise InvalidMediaURL(f"{where}.image_url.detail must be one of {', '.join(DETAILS)}, not {detail!r}")
    else:
        raise InvalidMediaURL(f"{where}: image_url must be an object with a 'url' (or a URL string)")
    if not isinstance(url, str) or not url:
        raise InvalidMediaURL(f"{where}: image_url.url must be a non-empty string")
    return url


def _as_dict(obj: Any) -> dict[str, Any]:
    """Plain dicts as they are; pydantic models (the server's schemas) through model_dump."""
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    raise InvalidMediaURL(f"expected an object, got {type(obj).__name__}")
