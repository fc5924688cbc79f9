"""kimi-k3-encode-images: the rows of each media item saved whole; every bad input one error line,
exit 2, nothing written."""
from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGUFValueType as T
from PIL import Image

from ggml_graph_spec.vision.preprocess import MAX_PIXELS, load_media
from ggml_graph_spec.vision.prompt import media_block

from tests.support.cli import run_tool
from tests.support.gguf_edit import rewritten_copy

from .conftest import files
from .test_preprocess import _png_header_only


def test_rows_grids_sizes_and_blocks_are_saved(tmp_path, k31pro_tiny_mmproj, exact_encoder):
    out = tmp_path / "rows.npz"
    clip = ",".join(map(str, files("vid_2x32x24")))
    r = run_tool("encode-images", k31pro_tiny_mmproj, *files("img_37x21"), "--video", clip, "-o", out, "-t", "1")
    assert r.rc == 0 and r.err == "" and "wrote" in r.out
    items = [load_media(files(n), exact_encoder.cfg) for n in ("img_37x21", "vid_2x32x24")]
    with np.load(out) as z:
        assert sorted(z.files) == sorted(f"{k}_{i}" for i in range(2) for k in ("rows", "grid", "size", "block"))
        for i, item in enumerate(items):
            assert np.array_equal(z[f"rows_{i}"], exact_encoder.encode(item))
            assert tuple(z[f"grid_{i}"]) == item.grid and tuple(z[f"size_{i}"]) == item.size
            assert str(z[f"block_{i}"]) == media_block(item)
    assert run_tool("encode-images", k31pro_tiny_mmproj, *files("img_37x21"), "-o", out).one_error_line(1, "exists")


@pytest.fixture
def inputs(tmp_path, k31pro_tiny_gguf, k31pro_tiny_mmproj):
    (tmp_path / "garbage.png").write_text("not an image")
    whole = files("img_48x32")[0].read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    side = math.isqrt(MAX_PIXELS) + 1
    _png_header_only(tmp_path / "huge.png", side, side)
    Image.new("RGB", (8, 8)).save(tmp_path / "a.gif", format="GIF")
    rewritten_copy(k31pro_tiny_mmproj, tmp_path / "k25.gguf", keys={"clip.projector_type": ("kimik25", T.STRING)})
    return {"good": str(files("img_48x32")[0]), "mmproj": str(k31pro_tiny_mmproj), "text": str(k31pro_tiny_gguf),
            **{p.stem: str(p) for p in tmp_path.iterdir()}}


@pytest.mark.parametrize("model, image, needle", [
    ("mmproj", "garbage", "not a PNG, JPEG or WebP image"),
    ("mmproj", "cut", "cannot be decoded"),
    ("mmproj", "huge", "decompression-bomb limit"),
    ("mmproj", "a", "not a PNG, JPEG or WebP image"),  # a GIF
    ("text", "good", "not a Kimi K3 mmproj"),
    ("k25", "good", "clip.projector_type 'kimik25'"),
])
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, inputs, model, image, needle):
    out = tmp_path / "out"
    out.mkdir()
    r = run_tool("encode-images", inputs[model], inputs["good"], inputs[image], "-o", out / "rows.npz")
    r.one_error_line(2, needle)
    assert list(out.iterdir()) == []
