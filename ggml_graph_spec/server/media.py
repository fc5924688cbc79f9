"""Images in chat requests: OpenAI's `image_url` content parts, as `data:` URIs only.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo..."}}

Each part is decoded (base64, then Pillow with the CLI's checks: PNG, JPEG or WebP, whole, within
the decompression-bomb limit), preprocessed, and given to the chat template as an image part
(`{"type": "image", "width", "height"}`: the built-in K3 template writes K3's media block); the
rendered prompt's placeholders are then replaced by the images' rows (generation/media.py). A URL
that is not a data: URI is a 400: this server never fetches anything. Without --mmproj, an image
part is a 400 too.

A prompt with images is computed from scratch: its rows are not tokens the prompt cache could
compare, so it never reuses a slot's cached prefix and leaves no checkpoint. The images are
encoded in the request's worker thread, before its job is queued (beside the engine's steps),
one request at a time: the encoder is not shared by two threads at once.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import threading
import warnings
from typing import Any, Sequence

import numpy as np
from PIL import Image

from ..engine.model import Model
from ..generation.media import MediaPrompt, media_runs, plan_media
from ..vision.encode import VisionEncoder
from ..vision.preprocess import FORMATS, MAX_PIXELS, MediaError, MediaItem, image_from_bytes, media_item
from ..vision.prompt import PromptError, media_part
from .errors import bad_request

IMAGE_PART = "image_url"
MAX_REQUEST_PIXELS = 16 * MAX_PIXELS  # the pixels of one request's images, in all (PixelBudget)
_DATA_URI = re.compile(r"data:(?:[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[^;,]*)*;base64,(?P<data>.*)", re.DOTALL)


class Vision:
    """The server's vision encoder (--mmproj), shared by the request threads."""

    def __init__(self, encoder: VisionEncoder) -> None:
        self.encoder = encoder
        self._lock = threading.Lock()
        # One image decoded at a time, server-wide: a decoded image may take up to Pillow's limit of
        # pixels (89 M, ~360 MB as RGBA) before it is resized, so memory holds one such at most.
        self._decoding = threading.Lock()

    def item(self, part: Any, where: str, budget: "PixelBudget | None" = None) -> MediaItem:
        """An image_url part's image, read and preprocessed (400 for anything else); its pixels
        taken from the request's `budget` before it is decoded."""
        url = part.get(IMAGE_PART)
        url = url.get("url") if isinstance(url, dict) else None
        if not isinstance(url, str):
            raise bad_request(f"'{where}.image_url.url' must be a string: a data: URI of the image")
        if not url.startswith("data:"):
            raise bad_request(f"'{where}.image_url.url' is not a data: URI: this server never fetches a URL; send "
                              "the image inline, as data:image/png;base64,...")
        m = _DATA_URI.fullmatch(url)
        if m is None:
            raise bad_request(f"'{where}.image_url.url' must be a base64 data: URI (data:image/png;base64,...)")
        try:
            data = base64.b64decode(m["data"], validate=True)
            if budget is not None:
                budget.take(data, where)
            with self._decoding:
                return media_item([image_from_bytes(data, where)], self.encoder.cfg, where)
        except binascii.Error:
            raise bad_request(f"'{where}.image_url.url': the data is not valid base64") from None
        except MediaError as exc:
            raise bad_request(str(exc)) from None

    def plan(self, prompt: Sequence[int], items: Sequence[MediaItem]) -> MediaPrompt:
        try:
            return plan_media(self.encoder, prompt, items)
        except PromptError as exc:  # a template of one's own that drops or repeats the placeholder
            raise bad_request(f"the chat template's rendering does not fit the images: {exc}") from None

    def runs(self, model: Model, prompt: MediaPrompt) -> list[np.ndarray]:
        """The prompt as runs of token ids and rows, the images encoded."""
        with self._lock:
            return media_runs(model, self.encoder, prompt)

    def close(self) -> None:
        self.encoder.close()


class PixelBudget:
    """The pixels one request's images may have in all (MAX_REQUEST_PIXELS): a body of small
    files that each decode to Pillow's limit would otherwise keep the decoder busy for minutes.
    Each image's size is read from its header, before it is decoded."""

    def __init__(self, pixels: int = 0) -> None:
        self.left = pixels or MAX_REQUEST_PIXELS

    def take(self, data: bytes, where: str) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size is refused in words
                with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                    pixels = image.width * image.height
        except Exception:  # noqa: BLE001 - not an image: its decoding says what it is
            return
        if pixels > self.left:
            raise bad_request(f"'{where}': the request's images have more than {MAX_REQUEST_PIXELS} pixels in all")
        self.left -= pixels


def image_parts(messages: list[dict], vision: Vision | None) -> tuple[list[dict], list[MediaItem]]:
    """The messages with each image_url part made the template's image part, and the images in order."""
    out, items, budget = [], [], PixelBudget()
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list) or not any(p["type"] == IMAGE_PART for p in content):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            if part["type"] == IMAGE_PART:
                where = f"messages[{i}].content[{j}]"
                if vision is None:
                    raise bad_request(f"'{where}' is an image: this server has no vision encoder (start it with "
                                      "--mmproj MMPROJ.gguf)")
                items.append(vision.item(part, where, budget))
                part = media_part(items[-1])
            parts.append(part)
        out.append({**m, "content": parts})
    return out, items
