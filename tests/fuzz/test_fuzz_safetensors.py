"""Fuzz the safetensors shard header reader: every file either reads into entries that lie inside
the file, or fails with one CheckpointError line; the tensor views of an accepted file all work."""
from __future__ import annotations

import json
import math
import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gguf_arch.errors import CheckpointError
from gguf_arch.io.safetensors import NUMPY_DTYPES, Checkpoint, read_shard_header

from .harness import FUZZ, assert_clean, corpus_files

SHARD = "model-00001-of-00001.safetensors"
DTYPES = [*NUMPY_DTYPES, "F8_E4M3", "bf16", "", "I128"]
JSON_JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                         max_leaves=6)
NAMES = st.text(max_size=12) | st.sampled_from(["__metadata__", "a\nb", "\ud800", "x" * 300, "\x1b[31mred"])
DIMS = st.integers(0, 6) | st.sampled_from([-1, 2 ** 31, 2 ** 40, 2 ** 64, True, 1.5, "3", None])


@st.composite
def _entry(draw, pos: int) -> tuple[dict, int]:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=3) | st.lists(DIMS, max_size=3))
    size = NUMPY_DTYPES[dtype].itemsize if dtype in NUMPY_DTYPES else 1
    nbytes = math.prod(d for d in shape if isinstance(d, int)) * size
    kind = draw(st.sampled_from(["consistent", "consistent", "overlap", "beyond", "reversed", "random"]))
    start = {"overlap": max(0, pos - 1), "beyond": pos + 2 ** 20}.get(kind, pos)
    offsets = [start, start + nbytes] if kind != "reversed" else [start + nbytes + 1, start]
    if kind == "random":
        offsets = draw(st.lists(DIMS, max_size=3))
    entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    broken = draw(st.sampled_from([None, None, None, "dtype", "shape", "data_offsets"]))
    if broken:
        if draw(st.booleans()):
            del entry[broken]
        else:
            entry[broken] = draw(JSON_JUNK)
    return entry, max(pos, start + nbytes) if isinstance(start + nbytes, int) else pos


@st.composite
def shard_bytes(draw) -> bytes:
    header, pos = {}, 0
    for _ in range(draw(st.integers(0, 5))):
        name = draw(NAMES)
        header[name], pos = draw(_entry(pos))
    if draw(st.booleans()):
        header["__metadata__"] = draw(JSON_JUNK)
    text = json.dumps(header).encode()
    if text and draw(st.integers(0, 4)) == 0:  # a non-UTF-8 byte somewhere in the JSON
        i = draw(st.integers(0, len(text) - 1))
        text = text[:i] + b"\xff" + text[i + 1:]
    data = draw(st.binary(min_size=0, max_size=64)) + bytes(draw(st.integers(0, max(0, min(pos, 4096)))))
    hlen = draw(st.sampled_from([len(text)] * 4 + [0, len(text) + 1, len(text) - 1, 2 ** 64 - 1, 2 ** 27])
                | st.integers(0, 2 ** 64 - 1))
    return struct.pack("<Q", max(0, hlen)) + text + data


def _check_file(path) -> None:
    """The invariants of an accepted shard, or one clean CheckpointError line."""
    try:
        entries = read_shard_header(path)
    except Exception as exc:  # noqa: BLE001 - the point is to see which exception it is
        assert_clean(exc, CheckpointError)
        return
    size = path.stat().st_size
    hlen = struct.unpack("<Q", path.read_bytes()[:8])[0]
    spans = sorted((e.start, e.start + e.nbytes) for e in entries.values() if e.nbytes)
    assert all(8 + hlen <= s <= e <= size for s, e in spans)
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    with Checkpoint(path.parent, entries) as ckpt:
        for name, e in entries.items():
            assert ckpt.array(name).shape == e.meta.shape


@FUZZ
@given(blob=shard_bytes())
def test_structured_headers(tmp_path, blob):
    (tmp_path / SHARD).write_bytes(blob)
    _check_file(tmp_path / SHARD)


@FUZZ
@given(blob=st.binary(max_size=64))
def test_random_bytes(tmp_path, blob):
    (tmp_path / SHARD).write_bytes(blob)
    _check_file(tmp_path / SHARD)


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_header(tmp_path, depth):
    text = b"[" * depth + b"]" * depth
    (tmp_path / SHARD).write_bytes(struct.pack("<Q", len(text)) + text)
    _check_file(tmp_path / SHARD)


def test_a_header_with_a_huge_tensor_count(tmp_path):
    """100,000 one-byte tensors (7 MB of JSON) are read and checked (quadratic checks would not
    finish; bench/planning.py measures the time: about 1 s, 3x json.loads of the header)."""
    n = 100_000
    text = json.dumps({f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)}).encode()
    (tmp_path / SHARD).write_bytes(struct.pack("<Q", len(text)) + text + bytes(n))
    assert len(read_shard_header(tmp_path / SHARD)) == n


@pytest.mark.parametrize("dims", [[2 ** 62, 2 ** 62], [2 ** 64], [10 ** 30, 0]])
def test_huge_dims(tmp_path, dims):
    text = json.dumps({"t": {"dtype": "F32", "shape": dims, "data_offsets": [0, 4]}}).encode()
    (tmp_path / SHARD).write_bytes(struct.pack("<Q", len(text)) + text + bytes(4))
    _check_file(tmp_path / SHARD)


@pytest.mark.parametrize("path", corpus_files("safetensors"), ids=lambda p: p.name)
def test_corpus(tmp_path, path):
    (tmp_path / SHARD).write_bytes(path.read_bytes())
    _check_file(tmp_path / SHARD)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_shard_that_is_not_a_regular_file(tmp_path, kind):
    """A FIFO under a shard's name would block a plain open() forever; it is refused at once."""
    path = tmp_path / SHARD
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(CheckpointError, match="not a regular file" if kind == "fifo" else "is a directory"):
        read_shard_header(path)
