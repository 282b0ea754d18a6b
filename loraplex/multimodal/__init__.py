"""Image inputs, made safe: where images are in a request, fetching them within policy, decoding
them within limits. No model code: the model's processor takes the RGB images from here.

    urls = split_chat_images(messages).urls        # OpenAI: content parts -> {"type": "image"}
    text, urls = split_markdown_images(inputs, "<image>")   # native: ![](URL) -> placeholder
    images = await load_images(urls, config)       # count, fetch, check, decode: RGB PIL images
    async with open_images(urls, config) as images:  # the same, their decoded bytes held against
        ...                                          # the server-wide budget until the block ends
"""

from loraplex.multimodal.chat_parts import ChatWithImages, split_chat_images
from loraplex.multimodal.budget import DecodeBudget
from loraplex.multimodal.config import MediaConfig
from loraplex.multimodal.decode import decode_image
from loraplex.multimodal.errors import (
    InvalidMediaURL,
    MediaDecodeError,
    MediaError,
    MediaFetchError,
    MediaFetchTimeout,
    MediaNotAllowed,
    MediaTooLarge,
    UnsupportedMediaType,
)
from loraplex.multimodal.fetch import fetch_image_bytes
from loraplex.multimodal.load import check_decoded_bytes, check_image_count, load_images, open_images
from loraplex.multimodal.markdown import TextWithImages, split_markdown_images

__all__ = [
    "ChatWithImages",
    "DecodeBudget",
    "InvalidMediaURL",
    "MediaConfig",
    "MediaDecodeError",
    "MediaError",
    "MediaFetchError",
    "MediaFetchTimeout",
    "MediaNotAllowed",
    "MediaTooLarge",
    "TextWithImages",
    "UnsupportedMediaType",
    "check_decoded_bytes",
    "check_image_count",
    "decode_image",
    "fetch_image_bytes",
    "load_images",
    "open_images",
    "split_chat_images",
    "split_markdown_images",
]
