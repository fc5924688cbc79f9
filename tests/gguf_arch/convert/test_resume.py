"""--resume: a killed conversion continues; finished files are verified, not trusted; the result is
byte-identical to an uninterrupted run; without --resume the leftovers are refused."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import convert_kimi_k3
from gguf_arch.io.manifest import manifest_path
from gguf_arch.io.gguf_writer import partial_path
from tests.support.cli import run_cli, start_cli
from tests.support.manifests import write_legacy_manifest

SPLIT = ("--split-max-tensors", "150")
PARTS = [f"k3-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
# ~10 ms per tensor: the 353-tensor conversion takes seconds, so the kill lands inside part 2.
SLOW = ("import time, gguf_arch.convert.run as m\nreal = m.tensor_chunks\n"
        "def slow(*a):\n    time.sleep(0.01)\n    return real(*a)\nm.tensor_chunks = slow")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def uninterrupted(k3_tiny_dir, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("whole")
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(out / "k3.gguf"), "--quiet", *SPLIT]) == 0
    files = _files(out)
    assert sorted(files) == sorted([*PARTS, *(f"{p}.manifest.json" for p in PARTS)])
    return files


def _kill_after_first_part(model: Path, out: Path) -> None:
    proc = start_cli(model, out / "k3.gguf", "--quiet", *SPLIT, prelude=SLOW)
    first_done = manifest_path(out / PARTS[0])
    deadline = time.monotonic() + 120
    while not first_done.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert first_done.exists() and not (out / PARTS[2]).exists(), sorted(p.name for p in out.iterdir())


def test_sigkill_after_the_first_part_then_resume(k3_tiny_dir, tmp_path, uninterrupted):
    _kill_after_first_part(k3_tiny_dir, tmp_path)
    first = tmp_path / PARTS[0]
    kept = first.stat()
    fresh = run_cli(k3_tiny_dir, tmp_path / "k3.gguf", "--quiet", *SPLIT)
    fresh.one_error_line(1, str(first), "already exists", "--resume")
    res = run_cli(k3_tiny_dir, tmp_path / "k3.gguf", *SPLIT, "--resume")
    assert res.rc == 0, res.err
    assert f"{first}: finished earlier, verified against {PARTS[0]}.manifest.json; kept" in res.out
    assert f"wrote {first}\n" not in res.out and f"wrote {tmp_path / PARTS[2]}" in res.out
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
    assert _files(tmp_path) == uninterrupted


def _resume(model: Path, out: Path, *flags: str):
    res = run_cli(model, out / "k3.gguf", *flags, "--resume")
    assert res.rc == 0, res.err
    return res.out


def _finished_copy(uninterrupted: dict[str, bytes], d: Path) -> None:
    for name, data in uninterrupted.items():
        (d / name).write_bytes(data)


def test_a_damaged_finished_part_is_rewritten(k3_tiny_dir, tmp_path, uninterrupted):
    _finished_copy(uninterrupted, tmp_path)
    target = tmp_path / PARTS[1]
    data = bytearray(target.read_bytes())
    data[-100] ^= 0x01  # a bit of the last tensor's bytes
    target.write_bytes(bytes(data))
    out = _resume(k3_tiny_dir, tmp_path, *SPLIT)
    assert f"{target}: not a verified finished file" in out and "BLAKE3 digest differs" in out
    assert out.count("; kept") == 2 and _files(tmp_path) == uninterrupted


def test_a_part_without_its_manifest_is_rewritten(k3_tiny_dir, tmp_path, uninterrupted):
    """Killed between the GGUF's rename and its manifest's: the file is complete but unproven."""
    _finished_copy(uninterrupted, tmp_path)
    manifest_path(tmp_path / PARTS[2]).unlink()
    out = _resume(k3_tiny_dir, tmp_path, *SPLIT)
    assert f"{tmp_path / PARTS[2]}: not a verified finished file" in out and "no integrity manifest" in out
    assert _files(tmp_path) == uninterrupted


def test_a_part_from_another_plan_is_rewritten(k3_tiny_dir, tmp_path, tmp_path_factory, uninterrupted):
    """Same name, intact, with its own valid manifest, but another split (120 tensors a part, also
    3 parts): its header is not the planned one, so it is rewritten, not kept."""
    other = tmp_path_factory.mktemp("other")
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(other / "k3.gguf"), "--quiet",
                                 "--split-max-tensors", "120"]) == 0
    _finished_copy(uninterrupted, tmp_path)
    for name in (PARTS[0], f"{PARTS[0]}.manifest.json"):
        (tmp_path / name).write_bytes((other / name).read_bytes())
    out = _resume(k3_tiny_dir, tmp_path, *SPLIT)
    assert f"{tmp_path / PARTS[0]}: not a verified finished file" in out
    assert _files(tmp_path) == uninterrupted


def test_everything_finished_writes_nothing(k3_tiny_dir, tmp_path, uninterrupted):
    _finished_copy(uninterrupted, tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    out = _resume(k3_tiny_dir, tmp_path, *SPLIT)
    assert out.count("; kept") == 3 and "wrote" not in out
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_parts_finished_by_a_sha256_converter_are_kept(k3_tiny_dir, tmp_path, uninterrupted):
    """A conversion an earlier converter (SHA-256 manifests, <part>.sha256.json) left unfinished:
    its finished parts are verified against those and kept; the rewritten part gets a BLAKE3 one."""
    _finished_copy(uninterrupted, tmp_path)
    for name in PARTS[:2]:
        manifest_path(tmp_path / name).unlink()
        write_legacy_manifest(tmp_path / name)
    (tmp_path / PARTS[2]).unlink()
    manifest_path(tmp_path / PARTS[2]).unlink()
    out = _resume(k3_tiny_dir, tmp_path, *SPLIT)
    assert f"verified against {PARTS[0]}.sha256.json; kept" in out and out.count("; kept") == 2
    assert {n: d for n, d in _files(tmp_path).items() if not n.endswith(".sha256.json")} == \
        {n: d for n, d in uninterrupted.items() if not n.startswith(tuple(PARTS[:2])) or n in PARTS}


def test_overwrite_replaces_a_sha256_manifest(k3_tiny_dir, k3_tiny_gguf, tmp_path):
    """An earlier conversion's OUT.gguf.sha256.json is claimed like the manifest: refused without
    --overwrite, removed with it, so one file never has two manifests."""
    out = tmp_path / "k3.gguf"
    out.write_bytes(k3_tiny_gguf.read_bytes())
    legacy = write_legacy_manifest(out)
    out.unlink()
    run_cli(k3_tiny_dir, out, "--quiet").one_error_line(1, f"{legacy}: already exists")
    assert run_cli(k3_tiny_dir, out, "--quiet", "--overwrite").rc == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k3.gguf", "k3.gguf.manifest.json"]


def test_unsplit_partial_is_rewritten(k3_tiny_dir, k3_tiny_gguf, tmp_path):
    out = tmp_path / "k3.gguf"
    partial_path(out).write_bytes(b"GGUF half of something")
    run_cli(k3_tiny_dir, out, "--quiet").one_error_line(1, f"{partial_path(out)}: exists", "--resume")
    _resume(k3_tiny_dir, tmp_path)
    assert out.read_bytes() == k3_tiny_gguf.read_bytes() and not partial_path(out).exists()


def test_resume_and_overwrite_together_is_a_usage_error(k3_tiny_dir, tmp_path, capsys):
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(tmp_path / "k3.gguf"), "--resume", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "pick one" in err
    assert list(tmp_path.iterdir()) == []


def test_a_symlinked_part_is_refused(k3_tiny_dir, tmp_path, uninterrupted):
    _finished_copy(uninterrupted, tmp_path)
    target = tmp_path / "elsewhere.gguf"
    os.replace(tmp_path / PARTS[1], target)
    (tmp_path / PARTS[1]).symlink_to(target)
    run_cli(k3_tiny_dir, tmp_path / "k3.gguf", *SPLIT, "--resume").one_error_line(1, "symbolic link")
    assert target.read_bytes() == uninterrupted[PARTS[1]]
