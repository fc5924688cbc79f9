"""Images a client should not send, on kimi-k3-server --mmproj: each is a 400 naming the part, or a
correct reply. A 16-bit greyscale PNG replies as its 8-bit top byte does (Pillow's convert made
it white); an animated PNG or WebP as its first frame; a decompression bomb, more pixels in one
request than the budget, base64 that is not, are 400s; extreme and odd shapes and modes reply. The
server serves on, with no traceback."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from ggml_graph_spec.server.errors import ApiError
from ggml_graph_spec.server.media import MAX_REQUEST_PIXELS, PixelBudget
from ggml_graph_spec.vision.preprocess import MAX_PIXELS
from tests.ggml_graph_spec.vision.test_cli_images import AS_IS
from tests.support.server import LiveServer, LogRecords

N_CTX_SLOT = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory, k31pro_tiny_gguf, k31pro_tiny_mmproj):
    template = tmp_path_factory.mktemp("template") / "as-is.jinja"
    template.write_text(AS_IS, encoding="utf-8")
    s = LiveServer(k31pro_tiny_gguf, "--mmproj", k31pro_tiny_mmproj, "-np", 1, "-c", N_CTX_SLOT,
                   "--exact-experts", "--chat-template-file", template)
    yield s
    s.close()


def _encoded(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def _ask(server, data: bytes | str, mime: str = "image/png"):
    url = data if isinstance(data, str) else f"data:{mime};base64,{base64.b64encode(data).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": " shows"}]
    return server.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                          "max_tokens": 6, "temperature": 0})


def _reply(server, data: bytes, mime: str = "image/png") -> str:
    r = _ask(server, data, mime)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png(width: int, height: int, depth: int, colour: int, rows: bytes) -> bytes:
    """A PNG written by hand: the depths and headers Pillow would not write."""
    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b"")


def _grey16(values: np.ndarray) -> bytes:
    return _png(values.shape[1], values.shape[0], 16, 0, b"".join(b"\0" + row.astype(">u2").tobytes() for row in values))


def test_a_16_bit_greyscale_png_replies_as_its_top_byte(server):
    values = (np.add.outer(np.arange(24), np.arange(40)) * 700 % 65536).astype(np.uint16)
    eight = _encoded(Image.fromarray((values >> 8).astype(np.uint8), "L"))
    white = _encoded(Image.new("L", (40, 24), 255))
    assert _reply(server, _grey16(values)) == _reply(server, eight) != _reply(server, white)


@pytest.mark.parametrize("fmt, mime, options", [("PNG", "image/png", {}), ("WEBP", "image/webp", {"lossless": True})])
def test_an_animated_image_replies_as_its_first_frame(server, fmt, mime, options):
    first = Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 48, 3), dtype=np.uint8))
    second = Image.fromarray(np.random.default_rng(2).integers(0, 256, (32, 48, 3), dtype=np.uint8))
    animated = _encoded(first, fmt, save_all=True, append_images=[second], duration=100, **options)
    assert Image.open(io.BytesIO(animated)).n_frames == 2
    assert _reply(server, animated, mime) == _reply(server, _encoded(first)) != _reply(server, _encoded(second))


@pytest.mark.parametrize("make", [
    lambda: Image.new("RGB", (1, 300), (9, 99, 199)), lambda: Image.new("RGB", (300, 1), (9, 99, 199)),
    lambda: Image.new("1", (33, 17), 1), lambda: Image.new("LA", (33, 17), (5, 100)),
    lambda: Image.new("P", (33, 17), 3), lambda: Image.new("RGBA", (7, 5), (0, 0, 0, 0)),
], ids=["1x300", "300x1", "1-bit", "LA", "palette", "transparent"])
def test_extreme_shapes_and_odd_modes_reply(server, make):
    assert _reply(server, _encoded(make()))


def test_a_cmyk_jpeg_replies(server):
    assert _reply(server, _encoded(Image.new("CMYK", (33, 17), (1, 2, 3, 4)), "JPEG"), "image/jpeg")


@pytest.mark.parametrize("url, needle", [
    ("data:image/png;base64,iVBO Rw0K", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # padding missing
    ("data:image/png;base64,-_-_", "not valid base64"),  # the URL-safe alphabet
    ("data:image/png;base64,", "not a PNG, JPEG or WebP image"),
])
def test_base64_that_is_not_is_a_400_naming_the_part(server, url, needle):
    r = _ask(server, url)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert "messages[0].content[0]" in r.json()["error"]["message"]


def test_a_decompression_bomb_is_a_400_before_it_is_decoded(server):
    bomb = _png(30000, 30000, 8, 0, b"")  # 900 M pixels said by a header of a few bytes
    with LogRecords() as logs:
        r = _ask(server, bomb)
    assert r.status_code == 400 and "decompression-bomb limit" in r.json()["error"]["message"], r.text
    assert not logs.lines() and not server.tracebacks()


def test_a_requests_images_have_a_pixel_budget_read_from_their_headers():
    """Sixteen times Pillow's limit in all: a body of small files that each decode to the limit
    would keep the decoder busy for minutes. Headers only: nothing here is decoded."""
    header = _png(9000, 9000, 8, 0, b"")
    budget = PixelBudget()
    taken = MAX_REQUEST_PIXELS // (9000 * 9000)
    for _ in range(taken):
        budget.take(header, "x")
    with pytest.raises(ApiError, match="more than 1431655760 pixels in all"):
        budget.take(header, "messages[0].content[17]")
    assert MAX_REQUEST_PIXELS == 16 * MAX_PIXELS


def test_the_server_serves_on(server):
    assert server.idle() and not server.tracebacks()
    assert _reply(server, _encoded(Image.new("RGB", (24, 24), (200, 30, 30))))
