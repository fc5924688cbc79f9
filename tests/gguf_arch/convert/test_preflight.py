"""Preflight: free space for the exact planned output plus headroom, shards present and complete,
refused with one line before a byte is written."""
from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

import convert_kimi_k3
import gguf_arch.convert.preflight as preflight
from gguf_arch.convert.listing import planned_files
from gguf_arch.errors import EXIT_BAD_INPUT, EXIT_RUNTIME
from gguf_arch.io.split import SplitLimits

Usage = namedtuple("Usage", "total used free")


def _with_free(monkeypatch, free: int) -> list[Path]:
    asked = []

    def disk_usage(path):
        asked.append(Path(path))
        return Usage(free * 2, free, free)
    monkeypatch.setattr(preflight.shutil, "disk_usage", disk_usage)
    return asked


def _planned(model: Path, out: Path, split: SplitLimits = SplitLimits()) -> int:
    files, _ = planned_files(model, out, split=split)
    return sum(f.size for f in files)


def _main(capsys, *args) -> tuple[int, str]:
    rc = convert_kimi_k3.main([*map(str, args)])
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("flags", [(), ("--split-max-tensors", "150")])
def test_one_byte_short_is_refused_exactly_enough_is_written(k3_tiny_dir, tmp_path, monkeypatch, capsys, flags):
    out = tmp_path / "k3.gguf"
    planned = _planned(k3_tiny_dir, out, SplitLimits(max_tensors=int(flags[1])) if flags else SplitLimits())
    need = planned + preflight.headroom(planned)
    asked = _with_free(monkeypatch, need - 1)
    rc, err = _main(capsys, k3_tiny_dir, out, "--quiet", *flags)
    assert rc == EXIT_RUNTIME and len(err.strip().splitlines()) == 1, err
    assert f"{tmp_path}: " in err and f"({planned} bytes)" in err and "free" in err
    assert asked == [tmp_path] and list(tmp_path.iterdir()) == []
    _with_free(monkeypatch, need)
    rc, err = _main(capsys, k3_tiny_dir, out, "--quiet", *flags)
    assert rc == 0, err
    written = [p for p in tmp_path.iterdir() if p.suffix == ".gguf"]
    assert sum(p.stat().st_size for p in written) == planned


def test_headroom_is_64_mib_plus_one_percent():
    assert preflight.headroom(0) == 64 << 20
    assert preflight.headroom(1_000_000_000_000) == (64 << 20) + 10_000_000_000


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.npz", "*.py"))
    return dst


def test_truncated_shard_is_bad_input_before_any_output(k3_tiny_dir, tmp_path, capsys):
    model = _copy_model(k3_tiny_dir, tmp_path / "model")
    shard = sorted(model.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc, err = _main(capsys, model, out_dir / "k3.gguf", "--split-max-tensors", "150")
    assert rc == EXIT_BAD_INPUT and len(err.strip().splitlines()) == 1, err
    assert str(shard) in err and "truncated" in err
    assert list(out_dir.iterdir()) == []


def test_missing_shard_is_bad_input_before_any_output(k3_tiny_dir, tmp_path, capsys):
    model = _copy_model(k3_tiny_dir, tmp_path / "model")
    shard = sorted(model.glob("*.safetensors"))[0]
    shard.unlink()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc, err = _main(capsys, model, out_dir / "k3.gguf")
    assert rc == EXIT_BAD_INPUT and str(shard) in err and "not found" in err
    assert list(out_dir.iterdir()) == []
