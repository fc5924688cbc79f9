"""Faults during conversion: disk full, killed, source changed, unwritable or dangerous output.

In every case: the documented exit code, exactly one `error: ` line, and never a file under the
final output name that is not the complete conversion (byte-identical to an undisturbed run).
"""
from __future__ import annotations

import ctypes
import errno
import os
import random
import resource
import shutil
import signal
import time
from pathlib import Path

import pytest

import convert_kimi_k3
from gguf_arch.convert import run as convert_mod
from gguf_arch.io import gguf_writer as writer_mod
from gguf_arch.io.manifest import manifest_path
from gguf_arch.io.gguf_writer import partial_path

from tests.support.cli import run_cli, start_cli
from tests.support.paths import FIXTURES

K3_TINY = FIXTURES / "k3-tiny"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    """An undisturbed conversion of k3-tiny: what any file under the final name must equal."""
    out = tmp_path_factory.mktemp("ref") / "ref.gguf"
    assert convert_kimi_k3.main([str(K3_TINY), str(out), "--quiet"]) == 0
    return out.read_bytes()


@pytest.fixture
def model(tmp_path) -> Path:
    return Path(shutil.copytree(K3_TINY, tmp_path / "model"))


def _main_fails(capsys, code: int, *args, needles=()) -> str:
    rc = convert_kimi_k3.main([*map(str, args), "--quiet"])
    err = capsys.readouterr().err
    assert rc == code, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def _nothing_under(out: Path) -> None:
    assert not os.path.lexists(out) and not os.path.lexists(partial_path(out)), list(out.parent.iterdir())
    assert not os.path.lexists(manifest_path(out))


def _verify_ok(out: Path, model_dir: Path, capsys) -> None:
    assert convert_kimi_k3.main(["--verify", str(out), str(model_dir), "--quiet"]) == 0, capsys.readouterr().err


# ---- output filesystem full ------------------------------------------------------------------

@pytest.mark.parametrize("limit", [4096, 1_000_000], ids=["in-header", "in-data"])
def test_file_size_limit_is_a_clean_disk_full(tmp_path, limit):
    """A real limit: RLIMIT_FSIZE makes the kernel refuse the write that crosses it (EFBIG)."""
    out = tmp_path / "out.gguf"
    res = run_cli(K3_TINY, out, "--quiet",
                  preexec=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    res.one_error_line(1, f"writing {out} failed", "File too large")
    _nothing_under(out)


class _FillingFile:
    """A file object whose device fills up after `room` more bytes."""

    def __init__(self, f, room: int):
        self._f, self._room = f, room

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.mark.parametrize("room", [0, 300_000])
def test_injected_enospc_in_the_data(tmp_path, monkeypatch, capsys, room):
    real = writer_mod._write_data
    monkeypatch.setattr(writer_mod, "_write_data",
                        lambda fout, *a: real(_FillingFile(fout, room), *a))
    out = tmp_path / "out.gguf"
    _main_fails(capsys, 1, K3_TINY, out, needles=("No space left on device",))
    _nothing_under(out)


def test_injected_enospc_at_fsync(tmp_path, monkeypatch, capsys):
    """Delayed allocation: the device can report a full disk only when the data is flushed."""
    def fsync(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(writer_mod.os, "fsync", fsync)
    out = tmp_path / "out.gguf"
    _main_fails(capsys, 1, K3_TINY, out, needles=("No space left on device",))
    _nothing_under(out)


def test_disk_full_while_writing_the_manifest(tmp_path, monkeypatch, capsys, reference):
    """The GGUF is complete and in place; the manifest is not written, and the line says which."""
    from gguf_arch.io import manifest

    def dump(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(manifest.json, "dump", dump)
    out = tmp_path / "out.gguf"
    _main_fails(capsys, 1, K3_TINY, out, needles=(f"writing {manifest_path(out)} failed", "No space left"))
    assert out.read_bytes() == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf"]


# ---- killed ----------------------------------------------------------------------------------

_KILL = "import os, signal\ndef _die(*a, **k):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
KILL_POINTS = {
    # before any output exists: while reading the tokenizer
    "planning": "import gguf_arch.convert.run as m\nm.gguf_metadata = _die",
    # the header is in <out>.partial, no tensor data yet
    "after-header": "import gguf_arch.io.gguf_writer as m\nm._write_data = _die",
    # in the middle of the tensor data
    "mid-data": ("import gguf_arch.convert.run as m\nreal = m.tensor_chunks\n"
                 "m.tensor_chunks = lambda pt, *a: _die() if pt.name.startswith('blk.3.') else real(pt, *a)"),
    # data complete and fsync'd, not yet renamed
    "before-rename": "import gguf_arch.io.gguf_writer as m\nm.os.replace = _die",
    # renamed into place, the manifest not yet written
    "before-manifest": "import gguf_arch.convert.run as m\nm.write_manifest = _die",
}


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_then_a_fresh_run(tmp_path, capsys, reference, point):
    out = tmp_path / "out.gguf"
    res = run_cli(K3_TINY, out, "--quiet", prelude=_KILL + KILL_POINTS[point])
    assert res.rc == -signal.SIGKILL, res.err
    if point == "before-manifest":
        assert out.read_bytes() == reference  # complete; only the manifest is missing
        _main_fails(capsys, 1, "--verify", out, K3_TINY, needles=("no integrity manifest",))
        _main_fails(capsys, 1, K3_TINY, out, needles=("already exists", "--overwrite"))
    else:
        assert not out.exists()
        if partial_path(out).exists():  # the leftover is refused by name, and kept
            _main_fails(capsys, 1, K3_TINY, out, needles=(f"{partial_path(out)}: exists", "interrupted"))
            assert partial_path(out).exists() and not out.exists()
    assert convert_kimi_k3.main([str(K3_TINY), str(out), "--quiet", "--overwrite"]) == 0
    assert out.read_bytes() == reference and not partial_path(out).exists()
    _verify_ok(out, K3_TINY, capsys)


def test_sigkill_at_random_times(tmp_path, reference):
    """Seeded random kill times over a conversion slowed to ~4 s: whatever the moment, the final
    name holds either nothing or the complete, byte-identical conversion."""
    slow = ("import time, gguf_arch.convert.run as m\nreal = m.tensor_chunks\n"
            "def slow(*a):\n    time.sleep(0.01)\n    return real(*a)\nm.tensor_chunks = slow")
    rng = random.Random(8)
    for i in range(4):
        out = tmp_path / f"out{i}.gguf"
        proc = start_cli(K3_TINY, out, "--quiet", prelude=slow)
        time.sleep(rng.uniform(0.5, 5.0))
        proc.kill()
        proc.communicate(timeout=60)
        if out.exists():
            assert out.read_bytes() == reference


# ---- the source changes during the conversion ------------------------------------------------

def _touch_all(model: Path) -> None:
    for shard in model.glob("*.safetensors"):
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _append_to_all(model: Path) -> None:
    for shard in model.glob("*.safetensors"):
        with open(shard, "ab") as f:
            f.write(b"\0" * 64)


def _replace_all(model: Path) -> None:
    for shard in model.glob("*.safetensors"):
        copy = shard.with_name(shard.name + ".new")
        shutil.copy2(shard, copy)  # same size and mtime: only the inode tells
        os.replace(copy, shard)


@pytest.mark.parametrize("change", [_touch_all, _append_to_all, _replace_all], ids=["mtime", "size", "inode"])
def test_source_shard_changed_mid_conversion(model, tmp_path, monkeypatch, capsys, change):
    real = convert_mod.tensor_chunks
    done = []

    def chunks(pt, *a):
        if pt.name.startswith("blk.3.") and not done:
            change(model)
            done.append(pt.name)
        return real(pt, *a)
    monkeypatch.setattr(convert_mod, "tensor_chunks", chunks)
    out = tmp_path / "out.gguf"
    _main_fails(capsys, 2, model, out, needles=("changed since its header was read",))
    assert done
    _nothing_under(out)


# ---- where the output goes -------------------------------------------------------------------

_PR_CAPBSET_DROP, _CAP_DAC_OVERRIDE = 24, 1  # <linux/prctl.h>, <linux/capability.h>


def _without_dac_override() -> None:
    """In the child before exec: root keeps its uid but loses the capability to ignore file modes."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_CAPBSET_DROP, _CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_read_only_output_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    out = ro / "out.gguf"
    res = run_cli(K3_TINY, out, "--quiet", preexec=_without_dac_override if os.geteuid() == 0 else None)
    res.one_error_line(1, f"writing {out} failed", "Permission denied")
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("where", ["top", "subdir", "via-symlink"])
def test_output_inside_the_model_directory_is_refused(model, tmp_path, capsys, where):
    (model / "sub").mkdir()
    (tmp_path / "link").symlink_to(model)
    out = {"top": model / "out.gguf", "subdir": model / "sub" / "out.gguf",
           "via-symlink": tmp_path / "link" / "out.gguf"}[where]
    before = sorted(p.name for p in model.rglob("*"))
    _main_fails(capsys, 2, model, out, "--overwrite", needles=("inside the model directory",))
    assert sorted(p.name for p in model.rglob("*")) == before


def test_output_named_like_a_shard_cannot_replace_it(model, capsys):
    shard = sorted(model.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    _main_fails(capsys, 2, model, shard, "--overwrite", needles=("inside the model directory",))
    assert shard.read_bytes() == data


@pytest.mark.parametrize("target_exists", [True, False], ids=["to-a-file", "dangling"])
def test_symlinked_output_is_refused_without_overwrite(tmp_path, capsys, target_exists):
    target = tmp_path / "precious.bin"
    if target_exists:
        target.write_bytes(b"keep me")
    out = tmp_path / "out.gguf"
    out.symlink_to(target)
    _main_fails(capsys, 1, K3_TINY, out, needles=("symbolic link", "--overwrite"))
    assert out.is_symlink() and (target.read_bytes() == b"keep me" if target_exists else not target.exists())


def test_overwrite_replaces_the_link_never_its_target(tmp_path, capsys, reference):
    target = tmp_path / "precious.bin"
    target.write_bytes(b"keep me")
    out = tmp_path / "out.gguf"
    out.symlink_to(target)
    assert convert_kimi_k3.main([str(K3_TINY), str(out), "--quiet", "--overwrite"]) == 0
    assert not out.is_symlink() and out.read_bytes() == reference
    assert target.read_bytes() == b"keep me"


def test_a_partial_planted_as_a_symlink_is_never_followed(tmp_path, capsys, reference):
    target = tmp_path / "precious.bin"
    target.write_bytes(b"keep me")
    out = tmp_path / "out.gguf"
    partial_path(out).symlink_to(target)
    _main_fails(capsys, 1, K3_TINY, out, needles=(f"{partial_path(out)}: exists",))
    assert convert_kimi_k3.main([str(K3_TINY), str(out), "--quiet", "--overwrite"]) == 0
    assert out.read_bytes() == reference and target.read_bytes() == b"keep me"
    assert not os.path.lexists(partial_path(out))
