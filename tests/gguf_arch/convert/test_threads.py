"""-j/--threads changes how the work is spread over threads, never the bytes written: every GGUF
and manifest is identical at -j 1 and -j 2, one file or split, for both fixtures, and with chunks
small enough that every large-tensor read, read-ahead and scan queue holds many of them."""
from __future__ import annotations

from pathlib import Path

import pytest

from gguf_arch.arch import transforms
from gguf_arch.convert.run import OutputOptions, convert
from gguf_arch.io import safetensors
from gguf_arch.io.split import SplitLimits, parse_size
from tests.support.cli import run_cli
from tests.support.paths import K3_TINY, K31PRO_TINY


def _files(out_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}


def _convert(model: Path, out_dir: Path, threads: int, split: SplitLimits) -> dict[str, bytes]:
    out_dir.mkdir()
    convert(model, out_dir / "out.gguf", output=OutputOptions(split=split, threads=threads), log=lambda _m: None)
    return _files(out_dir)


@pytest.mark.parametrize("model", [K3_TINY, K31PRO_TINY], ids=["k3-tiny", "k31pro-tiny"])
@pytest.mark.parametrize("split", [SplitLimits(), SplitLimits(parse_size("200K"), 0)], ids=["one-file", "split"])
def test_output_bytes_do_not_depend_on_threads_or_chunking(model, split, tmp_path, monkeypatch):
    want = _convert(model, tmp_path / "j1", 1, split)
    assert len(want) >= (4 if split.splits else 2)  # GGUF(s) and their manifests
    assert _convert(model, tmp_path / "j2", 2, split) == want
    # Tiny chunks: every tensor above 4 KiB is read as a ShardArray in 2 KiB preads, several in
    # flight, each scanned on the scanning thread; the bytes must still come out in file order.
    monkeypatch.setattr(safetensors, "WHOLE_BYTES", 4096)
    monkeypatch.setattr(transforms, "CHUNK_BYTES", 2048)
    assert _convert(model, tmp_path / "j2-small", 2, split) == want
    assert _convert(model, tmp_path / "j1-small", 1, split) == want


@pytest.mark.parametrize("value", ["0", "-3"])
def test_threads_below_one_is_a_usage_error(value, tmp_path):
    res = run_cli(K3_TINY, tmp_path / "out.gguf", "-j", value)
    res.one_error_line(2, "-j/--threads", "at least 1")
    assert not (tmp_path / "out.gguf").exists()


def test_threads_not_a_number_is_a_usage_error(tmp_path):
    run_cli(K3_TINY, tmp_path / "out.gguf", "--threads", "many").one_error_line(2, "-j/--threads", "many")


def test_threads_with_verify_is_refused(tmp_path):
    run_cli("--verify", tmp_path / "out.gguf", K3_TINY, "-j", "2").one_error_line(2, "--threads", "ignored")


def test_many_threads_keep_the_work_in_flight_bounded():
    # -j 1000 on a small machine: reads and repacks in flight stay a few chunks, not 1000.
    opts = OutputOptions(threads=1000)
    assert opts.read_ahead <= 4 and opts.repack_ahead <= 8
