"""Images to the tower's patches, exactly as Moonshot's K3 image processor makes them.

Per image (`media_proc_cfg`, carried by the mmproj as `MediaConfig`):

1. the scale that keeps the image within the patch limits, `min(1, sqrt(in_patch_limit /
   (max(1, W//p) * max(1, H//p))), side*p/W, side*p/H)`, and the new size `int(W*scale)`,
   `int(H*scale)` (at least 1, at most side*p); Pillow's bicubic resize to it (a copy when the size
   is unchanged), in the image's own mode;
2. a transparent image composited onto the configured background (K3: a chessboard), after the
   resize (or before it, as the processor's fill stage says), then RGB;
3. zero padding right and bottom to a multiple of merge*p (padded pixels are real patches the
   model sees: -1.0 after normalisation);
4. `x = float32(u8 / 255)`, then `(x - mean) * (1 / std)`, each step rounded to float32;
5. NaViT patches: (T, H, W, 3) -> (T*H/p*W/p, 3, p, p), row-major over (t, row, col), each patch
   channel-first.

The original width and height (before resize and padding) go into the prompt's media block.
Files are read with Pillow (PNG, JPEG, WebP; 16-bit greyscale as its top byte, an animated file as
its first frame); anything else, an unreadable or truncated file, an image beyond Pillow's
decompression-bomb limit, frames of a clip that differ in size or a clip
longer than the tower's time table are one-line `MediaError`s naming the file.
"""
from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from gguf_arch.arch.vision import BackgroundConfig, VisionConfig
from gguf_arch.errors import KimiError
from gguf_arch.io.jsonfile import NotRegularFile, open_regular

FORMATS = ("PNG", "JPEG", "WEBP")
# Pillow's own decompression-bomb limit: a larger image is refused before it is decoded.
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


class MediaError(KimiError):
    """An image file cannot be used (unreadable, truncated, too large, unsupported format)."""


@dataclass(frozen=True)
class MediaItem:
    """One image (t = 1) or clip (t > 1) ready for the tower."""

    pixel_values: np.ndarray  # float32 [t*h*w, 3, p, p]
    grid: tuple[int, int, int]  # (t, h, w) in patches
    size: tuple[int, int]  # original (width, height) in pixels
    source: str  # what it was read from, for messages

    @property
    def is_video(self) -> bool:
        return self.grid[0] > 1


def resized_size(width: int, height: int, vcfg: VisionConfig) -> tuple[int, int]:
    """The processor's size for an image of width x height: scaled down into the patch limits."""
    p, side, limit = vcfg.patch_size, vcfg.media.patch_limit_on_one_side, vcfg.media.in_patch_limit
    scale = min(1.0, math.sqrt(limit / (max(1.0, width // p) * max(1.0, height // p))),
                side * p / width, side * p / height)
    return (min(max(1, int(width * scale)), side * p), min(max(1, int(height * scale)), side * p))


def padded_size(width: int, height: int, vcfg: VisionConfig) -> tuple[int, int]:
    unit = vcfg.unit
    return (-(-width // unit) * unit, -(-height // unit) * unit)


def token_count(width: int, height: int, vcfg: VisionConfig) -> int:
    """Rows an image of this original size becomes (the processor's media_tokens_calculator)."""
    w, h = padded_size(*resized_size(width, height, vcfg), vcfg)
    return (w // vcfg.unit) * (h // vcfg.unit)


def open_image(path: Path | str) -> Image.Image:
    """The image at `path`, decoded whole; MediaError for anything Pillow cannot read as PNG, JPEG or WebP."""
    path = Path(path)
    try:
        os.close(open_regular(path))  # a FIFO under the name would block Pillow's open forever
    except FileNotFoundError:
        raise MediaError(f"{path}: not found") from None
    except NotRegularFile as exc:
        raise MediaError(f"{path}: {exc}") from None
    return _decode(path, str(path))


def image_from_bytes(data: bytes, where: str) -> Image.Image:
    """An image file's bytes (a data: URI's, say) decoded whole, with open_image's checks; `where`
    names it in messages."""
    return _decode(io.BytesIO(data), where)


def _decode(source: Path | io.BytesIO, where: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Sizes past Pillow's limit are refused here, before decoding, in this module's words.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source, formats=FORMATS)
        if image.width * image.height > MAX_PIXELS:
            raise MediaError(f"{where}: {image.width}x{image.height} pixels, more than the {MAX_PIXELS} an image "
                             "may have (Pillow's decompression-bomb limit)")
        image.load()
    except FileNotFoundError:
        raise MediaError(f"{where}: not found") from None
    except Image.UnidentifiedImageError:
        raise MediaError(f"{where}: not a PNG, JPEG or WebP image") from None
    except Image.DecompressionBombError as exc:
        raise MediaError(f"{where}: refused by Pillow's decompression-bomb limit ({exc})") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise MediaError(f"{where}: cannot be decoded ({type(exc).__name__}: {exc})") from None
    return _eight_bit(image)


def _eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit greyscale PNG (Pillow's I;16 and I modes) as the 8-bit greyscale image it shows: its
    values' top byte. Pillow's own convert to RGB clips every value past 255 to white. (16-bit
    colour PNGs Pillow already reads as 8-bit RGB, their top bytes.)"""
    if not image.mode.startswith("I"):
        return image
    values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8
    return Image.fromarray(values.astype(np.uint8), "L")


def _has_alpha(image: Image.Image) -> bool:
    return image.mode != "RGB" and ("A" in image.getbands() or "transparency" in image.info)


def _background(bg: BackgroundConfig, height: int, width: int) -> np.ndarray:
    if bg.pattern == "chessboard":
        ys, xs = np.arange(height) // bg.square_size, np.arange(width) // bg.square_size
        gray = (ys[:, None] + xs[None, :]) % 2 == (1 if bg.square_on_top_left else 0)
        plane = np.where(gray, bg.gray_value, bg.white_value).astype(np.uint8)
        return np.repeat(plane[:, :, None], 3, axis=2)
    value = {"white": 255, "black": 0, "gray": 128}[bg.pattern]
    return np.full((height, width, 3), value, dtype=np.uint8)


def to_rgb(image: Image.Image, bg: BackgroundConfig) -> Image.Image:
    """RGB, a transparent image composited onto the background as the processor does: in float32,
    alpha / 255, truncated back to uint8."""
    if image.mode == "RGB":
        return image
    if bg.pattern == "none" or not _has_alpha(image):
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))
    alpha = (rgba[:, :, 3].astype(np.float32) / 255.0)[:, :, None]
    back = _background(bg, *rgba.shape[:2])
    return Image.fromarray((alpha * rgba[:, :, :3] + (1 - alpha) * back).astype(np.uint8))


def frame_pixels(image: Image.Image, vcfg: VisionConfig) -> np.ndarray:
    """One image as the processor's uint8 [H, W, 3]: resized, composited, zero padded."""
    bg = vcfg.media.background
    if bg.fill_stage == "before_resize":
        image = to_rgb(image, bg)
    image = image.resize(resized_size(image.width, image.height, vcfg), resample=Image.Resampling.BICUBIC)
    rgb = np.asarray(to_rgb(image, bg))
    width, height = padded_size(rgb.shape[1], rgb.shape[0], vcfg)
    return np.pad(rgb, ((0, height - rgb.shape[0]), (0, width - rgb.shape[1]), (0, 0)))


def normalize(pixels: np.ndarray, vcfg: VisionConfig) -> np.ndarray:
    """uint8 -> float32 in the processor's order of roundings."""
    x = (pixels / 255.0).astype(np.float32)
    x -= np.asarray(vcfg.media.image_mean)
    x *= 1.0 / np.asarray(vcfg.media.image_std)
    return x


def patchify(frames: np.ndarray, patch: int) -> np.ndarray:
    """(T, H, W, 3) -> (T*H/p*W/p, 3, p, p): row-major patches, each channel-first."""
    t, h, w, c = frames.shape
    patches = frames.reshape(t, h // patch, patch, w // patch, patch, c).transpose(0, 1, 3, 5, 2, 4)
    return np.ascontiguousarray(patches.reshape(-1, c, patch, patch))


def media_item(images: Sequence[Image.Image], vcfg: VisionConfig, source: str) -> MediaItem:
    """One image, or the frames of one clip (all of one size, at most the tower's time table)."""
    sizes = {im.size for im in images}
    if len(sizes) != 1:
        raise MediaError(f"{source}: the frames of one clip must have one size, got {sorted(sizes)}")
    if not 1 <= len(images) <= vcfg.pos_emb_time:
        raise MediaError(f"{source}: {len(images)} frames; the tower's time embedding has "
                         f"{vcfg.pos_emb_time} (vision.pos_emb_time)")
    frames = np.stack([frame_pixels(im, vcfg) for im in images])
    p = vcfg.patch_size
    grid = (len(images), frames.shape[1] // p, frames.shape[2] // p)
    return MediaItem(patchify(normalize(frames, vcfg), p), grid, images[0].size, source)


def load_media(paths: Sequence[Path | str], vcfg: VisionConfig) -> MediaItem:
    """An image file (one path) or a clip's frame files (several), read and preprocessed."""
    return media_item([open_image(p) for p in paths], vcfg, ",".join(str(p) for p in paths))
