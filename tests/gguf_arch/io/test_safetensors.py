"""Header-first checkpoint reading, cross-checked against the safetensors package itself."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from gguf_arch.errors import CheckpointError
from gguf_arch.io import safetensors as st_reader
from gguf_arch.io.safetensors import open_checkpoint, read_shard_header

from tests.support.checkpoint_edit import EditableCheckpoint, write_shard
from tests.support.page_cache import evict_pages, resident_pages

TORCH_RAW = {torch.bfloat16: torch.int16, torch.float32: torch.float32, torch.uint8: torch.uint8}


@pytest.fixture(params=["buffered", "direct"])
def read_path(request, monkeypatch) -> str:
    """Every read buffered, or every read around the page cache (O_DIRECT, the large reads' path)."""
    monkeypatch.setattr(st_reader, "DIRECT_READ_MIN", 1 << 62 if request.param == "buffered" else 0)
    return request.param


def test_every_tensor_agrees_with_safe_open(k31pro_tiny_dir, read_path):
    with open_checkpoint(k31pro_tiny_dir) as ckpt:
        assert len(ckpt.entries) == 950
        shards = {e.shard for e in ckpt.entries.values()}
        for shard in shards:
            with safe_open(k31pro_tiny_dir / shard, framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    ours = ckpt.array(name)
                    assert ours.shape == tuple(t.shape), name
                    assert ours.tobytes() == t.view(TORCH_RAW[t.dtype]).numpy().tobytes(), name


def test_arrays_are_read_only_copies_and_large_ones_are_read_by_rows(k3_tiny_dir, monkeypatch, read_path):
    """No memory map (a truncated shard would SIGBUS it): small tensors are read whole into
    read-only arrays; above WHOLE_BYTES a ShardArray, whose row ranges read the same bytes."""
    name = "language_model.model.embed_tokens.weight"
    with open_checkpoint(k3_tiny_dir) as ckpt:
        whole = ckpt.array(name)
        assert isinstance(whole, np.ndarray)
        assert not whole.flags.writeable and whole.dtype == np.uint16 and whole.shape == (912, 64)
        monkeypatch.setattr(st_reader, "WHOLE_BYTES", 1024)
        lazy = ckpt.array(name)
        assert isinstance(lazy, st_reader.ShardArray) and lazy.shape == (912, 64) and lazy.nbytes == whole.nbytes
        assert np.array_equal(lazy[100:300], whole[100:300]) and np.array_equal(lazy.reshape(-1)[7:9001],
                                                                                 whole.reshape(-1)[7:9001])
        assert np.array_equal(np.asarray(lazy), whole) and np.array_equal(lazy[5:2], whole[5:2])


def test_a_shard_truncated_after_its_header_was_read_is_a_clean_error(tmp_path, k3_tiny_dir, read_path):
    ck = EditableCheckpoint(k3_tiny_dir, tmp_path / "m")
    name = "language_model.model.embed_tokens.weight"
    with open_checkpoint(ck.dir) as ckpt:
        shard = ck.dir / ckpt.entries[name].shard
        ckpt.stamps.clear()  # the stat check would see it first; the read itself must be safe too
        os.truncate(shard, ckpt.entries[name].start + 100)
        with pytest.raises(CheckpointError, match="truncated while it was being read"):
            ckpt.array(name)


EMBED = "language_model.model.embed_tokens.weight"


@pytest.fixture
def cold_embedding(tmp_path, k3_tiny_dir, monkeypatch):
    """(open checkpoint, the embedding's entry, its shard) with the shard out of the page cache and
    large reads from one block up (the fixture's tensors are small)."""
    monkeypatch.setattr(st_reader, "DIRECT_READ_MIN", 4096)
    ck = EditableCheckpoint(k3_tiny_dir, tmp_path / "m")
    with open_checkpoint(ck.dir) as ckpt:
        e = ckpt.entries[EMBED]
        shard = ck.dir / e.shard
        evict_pages(shard)
        if ckpt._direct_fd(e.shard, e.start, e.nbytes) is None:
            pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
        yield ckpt, e, shard


def test_large_reads_leave_no_page_in_the_page_cache(cold_embedding):
    """Large reads go around the page cache (a 1.5 TB conversion must not fill it and evict what
    is still to be read); the control read, buffered, does leave pages."""
    ckpt, e, shard = cold_embedding
    assert ckpt.array(EMBED).nbytes == e.nbytes
    assert resident_pages(shard, e.start, e.nbytes) == 0
    with open(shard, "rb") as f:
        f.seek(e.start)
        f.read(e.nbytes)
    assert resident_pages(shard, e.start, e.nbytes) > 0


def test_a_range_in_the_page_cache_is_read_through_it(cold_embedding, monkeypatch):
    """A large range the page cache holds whole is read buffered (an O_DIRECT read would go to the
    device again); once evicted, the same read goes around the cache. Same bytes either way."""
    ckpt, e, shard = cold_embedding
    real, direct_reads = st_reader.pread_direct, []
    monkeypatch.setattr(st_reader, "pread_direct", lambda *a: direct_reads.append(a[1:]) or real(*a))
    cold = np.array(ckpt.read_range(e, 0, e.nbytes // 2))
    assert direct_reads == [(e.start, e.nbytes)] and resident_pages(shard, e.start, e.nbytes) == 0
    shard.read_bytes()  # now cached
    assert np.array_equal(ckpt.read_range(e, 0, e.nbytes // 2), cold)
    assert len(direct_reads) == 1


def test_residency_of_a_file(tmp_path):
    from gguf_arch.io.residency import Residency
    path = tmp_path / "f"
    path.write_bytes(os.urandom(5 * 4096 + 100))
    evict_pages(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        r = Residency(fd)
        assert not r.cached(0, 100) and not r.cached(4096, 4096)
        os.pread(fd, 4096, 4096 + 10)  # reads (at least) page 1 into the cache
        assert r.cached(4096, 4096) and r.cached(4200, 100)
        assert not r.cached(0, 3 * 4096) and not r.cached(4096, 10 ** 9) and not r.cached(-1, 10)
        r.close()
        assert not r.cached(4096, 4096)
    finally:
        os.close(fd)


def test_a_refused_direct_read_falls_back_to_buffered(k3_tiny_dir, monkeypatch):
    """A file system that accepts O_DIRECT at open but refuses the read: the same bytes, buffered."""
    monkeypatch.setattr(st_reader, "DIRECT_READ_MIN", 0)
    real, calls = st_reader.pread_direct, []

    def refusing(fd, offset, nbytes):
        calls.append(offset)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(st_reader, "pread_direct", refusing)
    monkeypatch.setattr(st_reader.Residency, "cached", lambda *_: False)  # the fixture may be cached
    name = "language_model.model.embed_tokens.weight"
    with open_checkpoint(k3_tiny_dir) as ckpt:
        e = ckpt.entries[name]
        first = np.array(ckpt.read_range(e, 3, 5000))
        second = np.array(ckpt.read_range(e, 3, 5000))
    if not calls:
        pytest.skip("the file system refuses O_DIRECT at open: nothing to fall back from")
    assert len(calls) == 1  # buffered from then on
    monkeypatch.setattr(st_reader, "pread_direct", real)
    with open_checkpoint(k3_tiny_dir) as ckpt:
        assert np.array_equal(ckpt.read_range(ckpt.entries[name], 3, 5000), first)
        assert np.array_equal(first, second)


def test_tensor_in_a_shard_but_not_in_the_index(tmp_path, k3_tiny_dir):
    ck = EditableCheckpoint(k3_tiny_dir, tmp_path / "m")
    shard = ck.dir / "model-00002-of-000016.safetensors"
    ck.edit_shard(shard, lambda t: t.__setitem__("language_model.extra", ("F32", [2], bytes(8))))
    with pytest.raises(CheckpointError, match=r"holds tensor language_model\.extra but .* does not list it"):
        open_checkpoint(ck.dir)


def test_tensor_in_the_index_but_not_in_its_shard(tmp_path, k3_tiny_dir):
    ck = EditableCheckpoint(k3_tiny_dir, tmp_path / "m")
    ck.edit_weight_map(lambda wmap: wmap.update({"language_model.ghost": "model-00002-of-000016.safetensors"}))
    with pytest.raises(CheckpointError, match=r"language_model\.ghost is mapped to .* header does not contain it"):
        open_checkpoint(ck.dir)


def test_tensor_mapped_to_the_wrong_shard(tmp_path, k3_tiny_dir):
    ck = EditableCheckpoint(k3_tiny_dir, tmp_path / "m")
    ck.edit_weight_map(lambda wmap: wmap.update({"language_model.model.norm.weight": "model-00001-of-000016.safetensors"}))
    with pytest.raises(CheckpointError, match="model.norm.weight but .* maps it to model-00001"):
        open_checkpoint(ck.dir)


def test_byte_length_must_match_dtype_and_shape(tmp_path):
    path = tmp_path / "s.safetensors"
    write_shard(path, {"t": ("BF16", [3, 4], bytes(24))})
    assert read_shard_header(path)["t"].nbytes == 24
    write_shard(path, {"t": ("BF16", [3, 5], bytes(24))})
    with pytest.raises(CheckpointError, match=r"tensor t: BF16 \[3, 5\] needs 30 bytes but data_offsets \[0, 24\] span 24"):
        read_shard_header(path)


def test_shorter_than_the_length_field(tmp_path):
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated"):
        read_shard_header(path)


def test_missing_index_and_missing_shard(tmp_path, k3_tiny_dir):
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not found"):
        open_checkpoint(tmp_path)
    ck = EditableCheckpoint(k3_tiny_dir, tmp_path / "m")
    (ck.dir / "model-00003-of-000016.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00003-of-000016.safetensors: shard listed in .* not found"):
        open_checkpoint(ck.dir)
