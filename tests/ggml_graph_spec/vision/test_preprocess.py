"""Images to patches as Moonshot's processor makes them: the fixture's pixel values exactly, the
resize against Pillow's bicubic called as the processor calls it, the transparent background, and
one-line errors for files that cannot be used."""
from __future__ import annotations

import math
import os
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from gguf_arch.arch.vision import load_vision_config
from ggml_graph_spec.vision.preprocess import (MAX_PIXELS, MediaError, load_media, media_item, open_image,
                                               resized_size, token_count)

from .conftest import INPUTS, files


@pytest.fixture(scope="module")
def vcfg(k31pro_tiny_dir):
    return load_vision_config(k31pro_tiny_dir)[0]


@pytest.mark.parametrize("name", INPUTS)
def test_fixture_inputs_give_the_processors_pixel_values(vcfg, ref, name):
    item = load_media(files(name), vcfg)
    assert np.array_equal(item.pixel_values, ref[f"{name}/pixel_values"])  # bit for bit
    assert item.grid == tuple(ref[f"{name}/grid_thw"])
    assert token_count(*item.size, vcfg) == int(ref[f"{name}/num_tokens"])
    assert item.is_video == (name.startswith("vid"))


def _processor_size(w: int, h: int, p: int, limit: int, side: int) -> tuple[int, int]:
    """navit_resize_image's arithmetic, spelled here as the processor spells it."""
    s1 = math.sqrt(limit / (max(1.0, w // p) * max(1.0, h // p)))
    scale = min(1.0, s1, side * p / w, side * p / h)
    return min(max(1, int(w * scale)), side * p), min(max(1, int(h * scale)), side * p)


def _processor_patches(image: Image.Image, size: tuple[int, int], p: int, unit: int) -> np.ndarray:
    """Pillow's bicubic resize, zero padding right and bottom, (x/255 - 0.5)/0.5, NaViT patches."""
    a = np.asarray(image.resize(size, resample=Image.Resampling.BICUBIC).convert("RGB"))
    h, w = -(-a.shape[0] // unit) * unit, -(-a.shape[1] // unit) * unit
    a = np.pad(a, ((0, h - a.shape[0]), (0, w - a.shape[1]), (0, 0)))
    x = ((a / 255.0).astype(np.float32) - np.float32(0.5)) * np.float32(2.0)
    return x.reshape(h // p, p, w // p, p, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, p, p)


@pytest.mark.parametrize("size", [(1100, 1100), (3000, 100), (100, 2999), (1500, 900), (7, 5)])
def test_the_resize_is_pillows_bicubic_as_the_processor_calls_it(vcfg, size):
    """The fixtures never resize (every input is within the limits): large and odd sizes here."""
    rng = np.random.default_rng(sum(size))
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    p, m = vcfg.patch_size, vcfg.media
    want = _processor_size(*size, p, m.in_patch_limit, m.patch_limit_on_one_side)
    assert resized_size(*size, vcfg) == want
    if size != (7, 5):
        assert want != size and max(want) <= m.patch_limit_on_one_side * p  # the limits bite
    item = media_item([image], vcfg, "test")
    assert np.array_equal(item.pixel_values, _processor_patches(image, want, p, vcfg.unit))
    assert item.size == size  # the prompt's block names the original size
    if want != size:  # the resampling filter shows: bilinear would give other pixels
        bilinear = np.asarray(image.resize(want, resample=Image.Resampling.BILINEAR))
        assert not np.array_equal(bilinear, np.asarray(image.resize(want, resample=Image.Resampling.BICUBIC)))


def test_the_patch_limit_counts_whole_patches(vcfg):
    """in_patch_limit bounds (W//p)*(H//p) patches; a limit of 100 patches of 4 px on 80x80 (400)."""
    small = replace(vcfg, media=replace(vcfg.media, in_patch_limit=100))
    assert resized_size(80, 80, small) == (40, 40)
    assert token_count(80, 80, small) == 25


def _chessboard(h: int, w: int, square: int, white: int, gray: int) -> np.ndarray:
    bg = np.full((h, w, 3), white, dtype=np.uint8)
    for y in range(0, h, square):
        for x in range(0, w, square):
            if (y // square + x // square) % 2 == 1:
                bg[y:y + square, x:x + square] = gray
    return bg


def test_transparency_is_composited_onto_the_chessboard_after_the_resize(vcfg):
    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 256, (20, 24, 4), dtype=np.uint8)
    rgba[:6, :, 3] = 0  # fully transparent rows show the background
    item = media_item([Image.fromarray(rgba, "RGBA")], vcfg, "rgba")
    bg = vcfg.media.background
    assert (bg.pattern, bg.square_size, bg.white_value, bg.gray_value) == ("chessboard", 8, 255, 180)
    alpha = (rgba[:, :, 3].astype(np.float32) / 255.0)[:, :, None]
    want = (alpha * rgba[:, :, :3] + (1 - alpha) * _chessboard(20, 24, 8, 255, 180)).astype(np.uint8)
    want = np.pad(want, ((0, 4), (0, 0), (0, 0)))  # 20 -> 24 rows
    x = ((want / 255.0).astype(np.float32) - np.float32(0.5)) * np.float32(2.0)
    patches = x.reshape(6, 4, 6, 4, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, 4, 4)
    assert np.array_equal(item.pixel_values, patches)
    dropped = replace(vcfg, media=replace(vcfg.media, background=replace(bg, pattern="none")))
    plain = media_item([Image.fromarray(rgba, "RGBA")], dropped, "rgba")
    assert not np.array_equal(plain.pixel_values, item.pixel_values)  # alpha dropped: another picture


@pytest.mark.parametrize("fmt, ext", [("PNG", "png"), ("JPEG", "jpg"), ("WEBP", "webp")])
def test_png_jpeg_and_webp_are_read(vcfg, tmp_path, fmt, ext):
    rng = np.random.default_rng(5)
    image = Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8))
    path = tmp_path / f"a.{ext}"
    image.save(path, format=fmt)
    item = load_media([path], vcfg)
    decoded = Image.open(path)
    assert item.grid == (1, 4, 6) and np.array_equal(item.pixel_values, media_item([decoded], vcfg, "x").pixel_values)


def _png_header_only(path, width: int, height: int) -> None:
    """A PNG whose header claims width x height (no pixel data): what a decompression bomb looks like."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IEND", b""))


def _bad(path, *needles: str) -> None:
    with pytest.raises(MediaError) as exc:
        open_image(path)
    message = str(exc.value)
    assert "\n" not in message and str(path) in message
    for needle in needles:
        assert needle in message, message


def test_unusable_files_are_one_line_errors(tmp_path):
    (tmp_path / "text.png").write_text("not an image")
    _bad(tmp_path / "text.png", "not a PNG, JPEG or WebP image")
    _bad(tmp_path / "absent.png", "not found")
    os.mkfifo(tmp_path / "fifo.png")
    _bad(tmp_path / "fifo.png", "not a regular file")  # refused at once, never opened blocking
    Image.new("RGB", (8, 8)).save(tmp_path / "a.gif", format="GIF")
    _bad(tmp_path / "a.gif", "not a PNG, JPEG or WebP image")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.bmp", format="BMP")
    _bad(tmp_path / "a.bmp", "not a PNG, JPEG or WebP image")
    whole = tmp_path / "whole.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(whole)
    (tmp_path / "cut.png").write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    _bad(tmp_path / "cut.png", "cannot be decoded")
    side = math.isqrt(MAX_PIXELS) + 1
    _png_header_only(tmp_path / "huge.png", side, side)
    _bad(tmp_path / "huge.png", f"{side}x{side} pixels", "decompression-bomb limit")
    _png_header_only(tmp_path / "huger.png", 3 * side, 3 * side)
    _bad(tmp_path / "huger.png", "decompression")


def test_clip_frames_must_agree_and_fit_the_time_table(vcfg):
    frame = Image.new("RGB", (8, 8))
    with pytest.raises(MediaError, match="one size"):
        media_item([frame, Image.new("RGB", (8, 16))], vcfg, "clip")
    with pytest.raises(MediaError, match=f"5 frames; the tower's time embedding has {vcfg.pos_emb_time}"):
        media_item([frame] * 5, vcfg, "clip")
    assert media_item([frame] * 4, vcfg, "clip").grid == (4, 2, 2)
