"""Fuzz the runner's GGUF loader with damaged copies of a converted k3-tiny: truncated files, wrong
type ids, dims that disagree with the architecture, bad offsets, damaged keys and strings.

Each file goes to a separate process (`gguf_worker`): it must answer, not die on a ggml assert
or hang;
a refused file gets one clean KimiError line; an accepted one runs a forward pass without error.
"""
from __future__ import annotations

import json
import shutil

import pytest
from gguf import GGUFReader
from hypothesis import given
from hypothesis import strategies as st

from gguf_arch.io.manifest import check_hashes, manifest_path, read_manifest

from . import gguf_worker
from .gguf_worker import Worker
from .harness import CORPUS, FUZZ, assert_clean

EDGE_INTS = [0, 1, 2, 3, 7, 8, 9, 31, 32, 39, 40, 255, 256, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1,
             2 ** 32, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def base(k3_tiny_gguf) -> tuple[bytes, dict[tuple[str, int, int], tuple[int, int]]]:
    """The file's bytes and its patchable numbers (string bytes included): (field, part, element) ->
    (offset, size).

    Fields are named "kv:<key>" or "tensor:<name>"; parts are gguf-py's (for a tensor info:
    0 name length, 2 n_dims, 3 dims, 4 type id, 5 data offset). Mutations and the corpus name
    what they change this way, so they still mean the same after the header layout moves.
    """
    reader = GGUFReader(k3_tiny_gguf)
    origin = reader.data.ctypes.data
    fields = [(f"kv:{f.name}", f) for f in reader.fields.values()] + [(f"tensor:{t.name}", t.field) for t in reader.tensors]
    numbers = {(key, i, j): (p.ctypes.data - origin + j * p.itemsize, p.itemsize)
               for key, f in fields for i, p in enumerate(f.parts) for j in range(p.size)}
    return k3_tiny_gguf.read_bytes(), numbers


@st.composite
def mutation(draw, base) -> dict:
    blob, numbers = base
    patches = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(list(numbers)))
        size = numbers[key][1]
        value = draw(st.sampled_from(EDGE_INTS) | st.integers(0, 2 ** (8 * size) - 1)) % 2 ** (8 * size)
        patches.append([*key, value])
    truncate = draw(st.integers(0, len(blob) - 1)) if draw(st.integers(0, 3)) == 0 else None
    return {"patches": patches, "truncate": truncate}


def apply(base, m: dict) -> bytes:
    blob, numbers = base
    data = bytearray(blob)
    for field, part, element, value in m["patches"]:
        offset, size = numbers[(field, part, element)]
        data[offset:offset + size] = value.to_bytes(size, "little")
    return bytes(data[:m["truncate"]] if m["truncate"] is not None else data)


def _check(worker: Worker, path, m: dict) -> None:
    reply = worker.check(path)
    context = json.dumps(m)
    assert "died" not in reply, f"the loader process died ({reply['died']}) on mutation {context}"
    assert "hung" not in reply, f"the loader process hung ({reply['hung']} s) on mutation {context}"
    if "msg" in reply:
        assert reply["kimi"], f"{reply['type']} instead of a KimiError: {reply['msg']} ({context})"
        assert reply["msg"] and reply["msg"].splitlines() == [reply["msg"]], reply["msg"]


@FUZZ
@given(data=st.data())
def test_damaged_gguf(tmp_path, worker, base, data):
    m = data.draw(mutation(base))
    path = tmp_path / "m.gguf"
    path.write_bytes(apply(base, m))
    _check(worker, path, m)


def test_the_undamaged_file_loads_and_runs(worker, k3_tiny_gguf):
    assert worker.check(k3_tiny_gguf) == {"loaded": True}


@pytest.mark.parametrize("path", sorted((CORPUS / "gguf").glob("*.json")), ids=lambda p: p.name)
def test_corpus(tmp_path, worker, base, path):
    m = json.loads(path.read_text())
    out = tmp_path / "m.gguf"
    out.write_bytes(apply(base, m))
    _check(worker, out, m)


@FUZZ
@given(data=st.data())
def test_damaged_gguf_against_its_manifest(tmp_path, base, k3_tiny_gguf, data):
    """--verify's first stage: any changed byte is reported (one clean line), never missed."""
    m = data.draw(mutation(base))
    damaged = apply(base, m)
    path = tmp_path / "m.gguf"
    path.write_bytes(damaged)
    shutil.copyfile(manifest_path(k3_tiny_gguf), manifest_path(path))
    try:
        check_hashes(path, read_manifest(path))
    except Exception as exc:  # noqa: BLE001 - which exception it is, is the point
        assert_clean(exc)
    else:
        assert damaged == base[0], f"a damaged file passed its manifest: {json.dumps(m)}"


def test_the_harness_reports_an_abort_and_a_hang(monkeypatch, k3_tiny_gguf):
    """What a ggml assert does to the process (SIGABRT), and a child that never answers."""
    aborting = Worker("import os, sys; sys.stdin.readline(); os.abort()")
    assert aborting.check(k3_tiny_gguf)["died"] != 0
    monkeypatch.setattr(gguf_worker, "HANG_SECONDS", 1)
    assert Worker("import time; time.sleep(60)").check(k3_tiny_gguf) == {"hung": 1}
