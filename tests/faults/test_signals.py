"""Signals and races (class 6): SIGTERM and SIGHUP stop a conversion like Ctrl-C (exit 143, 129),
with one line saying what is left and whether --resume continues it; a Ctrl-C in a split
conversion names the complete parts; a second conversion to an OUT being written is refused at
once, naming the first one's PID. All in child processes, slowed so that the signal lands
mid-write; waits are bounded by deadlines (a failure, never a hang)."""
from __future__ import annotations

import signal
import time

import pytest

from gguf_arch.io.output_lock import lock_path
from gguf_arch.io.output_paths import manifest_path, partial_path
from tests.support.cli import run_cli, start_cli
from tests.support.paths import FIXTURES

K3_TINY = FIXTURES / "k3-tiny"
SLOW = ("import time, gguf_arch.convert.run as m\nreal = m.tensor_chunks\n"
        "def slow(*a):\n    time.sleep(0.02)\n    return real(*a)\nm.tensor_chunks = slow")
PARTS = ["o-00001-of-00003.gguf", "o-00002-of-00003.gguf", "o-00003-of-00003.gguf"]


def _wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_stop_signal_mid_write_leaves_nothing_and_says_so(tmp_path, sig, code):
    """Mid-write: the partial file exists and tensors have gone to the writer (the progress log
    says so; the partial's size does not: the writer stages 8 MiB before its first write)."""
    out_dir, log = tmp_path / "out", tmp_path / "progress.jsonl"
    out_dir.mkdir()
    out = out_dir / "o.gguf"
    proc = start_cli(K3_TINY, out, "--quiet", "--log-json", log, prelude=SLOW)
    _wait_for(lambda: partial_path(out).exists() and log.exists() and log.read_text().count("\n") >= 3,
              "the partial file and tensors written to it")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert err.count("\n") == 1 and err.startswith(f"error: interrupted ({signal.Signals(sig).name}); "), err
    assert "no output written" in err and "--resume has nothing to keep" in err
    assert list(out_dir.iterdir()) == []  # no partial, no manifest, no lock file


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "SIGTERM"])
def test_stop_in_a_split_conversion_names_the_complete_parts(tmp_path, sig):
    out = tmp_path / "o.gguf"
    args = (K3_TINY, out, "--quiet", "--split-max-tensors", "120")
    proc = start_cli(*args, prelude=SLOW)
    _wait_for(lambda: manifest_path(tmp_path / PARTS[0]).exists(), "part 1's manifest")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err.count("\n") == 1 and f"interrupted ({signal.Signals(sig).name})" in err, err
    assert f"of 3 parts complete with their manifests ({PARTS[0]}" in err and "--resume" in err, err
    assert "no output written" not in err
    res = run_cli(*args, "--resume")
    assert res.rc == 0, res.err
    assert run_cli("--verify", tmp_path / PARTS[0], K3_TINY, "--quiet").rc == 0


def test_a_second_conversion_to_the_same_out_is_refused_at_once(tmp_path):
    out = tmp_path / "o.gguf"
    first = start_cli(K3_TINY, out, "--quiet", prelude=SLOW)
    _wait_for(lambda: lock_path(out).exists() and lock_path(out).read_text().strip(), "the first run's lock")
    second = run_cli(K3_TINY, out, "--quiet", "--overwrite", timeout=60)
    second.one_error_line(1, f"another conversion (PID {first.pid})", str(out))
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert run_cli("--verify", out, K3_TINY, "--quiet").rc == 0
    assert not lock_path(out).exists()


def test_a_stale_lock_file_of_a_killed_run_is_taken_over(tmp_path):
    out = tmp_path / "o.gguf"
    lock_path(out).write_text("999999\n")  # no process holds it
    assert run_cli(K3_TINY, out, "--quiet").rc == 0
    assert not lock_path(out).exists()


def test_a_lock_file_planted_as_a_symlink_is_never_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    out = tmp_path / "o.gguf"
    lock_path(out).symlink_to(target)
    res = run_cli(K3_TINY, out, "--quiet")
    res.one_error_line(1, "lock")
    assert target.read_bytes() == b"keep me" and lock_path(out).is_symlink()
