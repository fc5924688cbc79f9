"""-j/--threads changes how the work is spread over threads, never the bytes written: every GGUF
and manifest is identical at -j 1 and -j 2, one file or split, for both fixtures, with chunks
small enough that every large-tensor read, read-ahead and scan queue holds many of them, and with
the chunks laid out for the writer (written from the buffers they were read into)."""
from __future__ import annotations

from pathlib import Path

import pytest

from gguf_arch.arch import transforms
from gguf_arch.convert.run import OutputOptions, convert
from gguf_arch.io import direct_io, safetensors
from gguf_arch.io.direct_io import BLOCK, SequentialWriter, address
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
    _lay_out_small_chunks(monkeypatch)
    assert _convert(model, tmp_path / "j2-laid-out", 2, split) == want


def _lay_out_small_chunks(monkeypatch) -> None:
    """The fixtures' tensors read in 16 KiB chunks into buffers laid out for the writer (as the
    converter does from 1 MiB up), and written straight from those from 8 KiB up."""
    monkeypatch.setattr(safetensors, "WHOLE_BYTES", 4096)
    monkeypatch.setattr(safetensors, "DIRECT_READ_MIN", 4096)
    monkeypatch.setattr(transforms, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(direct_io, "STRAIGHT_WRITE_MIN", 2 * BLOCK)


def test_large_chunks_reach_the_writer_laid_out_for_their_offset(tmp_path, monkeypatch):
    """Every chunk large enough to be written straight, after the header (built in memory), comes
    laid out for its offset in the output: its bytes were read (or repacked) where the writer
    writes them from, and only its ends are copied into the staging buffers."""
    _lay_out_small_chunks(monkeypatch)
    real, chunks = SequentialWriter.write, []

    def recording(self, data):
        view = memoryview(data).cast("B")
        chunks.append((len(view), (address(view) - self.tell()) % BLOCK == 0))
        return real(self, data)
    monkeypatch.setattr(SequentialWriter, "write", recording)
    _convert(K31PRO_TINY, tmp_path / "out", 2, SplitLimits())
    large = [laid_out for n, laid_out in chunks[1:] if n >= direct_io.STRAIGHT_WRITE_MIN]
    assert len(large) > 100 and all(large)


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
