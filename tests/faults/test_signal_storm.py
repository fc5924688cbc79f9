"""SIGINT and SIGTERM at random moments of a conversion and of a generation, on a machine kept
busy by a CPU hog: every run that was still going ends with 130 or 143 and exactly one line,
`error: interrupted (SIGNAME)...`, and a conversion leaves no partial file and no output that
looks complete without being so (an OUT there has its manifest).

The moments are random (a fixed seed, KIMI_SIGNAL_SEED to change it); the outcome must not be.
Each moment counts from the child's first heavy import, after its handlers were installed: a
signal during the interpreter's own start-up is outside the contract."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import tool_code
from tests.support.paths import FIXTURES, REPO

K3_TINY = FIXTURES / "k3-tiny"
SEED = int(os.environ.get("KIMI_SIGNAL_SEED", "20251206"))
RUNS = 8
STARTED = """
import sys
from pathlib import Path
class _Started:
    def find_spec(self, name, path=None, target=None):
        if name in ("numpy", "ggml"):
            sys.meta_path.remove(self)
            Path({marker!r}).touch()
        return None
sys.meta_path.insert(0, _Started())
"""


@pytest.fixture(scope="module")
def cpu_hog():
    """One busy loop per CPU, for the module's duration."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    yield
    for h in hogs:
        h.kill()
        h.wait()


def _signal_at_random(tool: str, args: list[str], marker: Path, delay: float, sig: int) -> tuple[int, str] | None:
    """(exit code, stderr) of the tool signalled `delay` seconds after its first heavy import;
    None when it had finished before the moment came."""
    proc = subprocess.Popen([sys.executable, "-c", tool_code(tool, STARTED.format(marker=str(marker))), *args],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)
        if proc.poll() is not None:
            proc.communicate(timeout=60)
            return None
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def _check(result: tuple[int, str], sig: int, moment: str) -> str:
    rc, err = result
    lines = err.rstrip("\n").splitlines()
    assert rc == 128 + sig, (moment, rc, err)
    assert lines and lines[-1].startswith(f"error: interrupted ({signal.Signals(sig).name})"), (moment, err)
    assert [l for l in lines if l.startswith("error")] == lines[-1:], (moment, err)
    assert "Traceback" not in err and "Exception ignored" not in err, (moment, err)
    return lines[-1]


def test_conversions_stopped_at_random_moments_always_end_as_documented(tmp_path, cpu_hog):
    rng, stopped = random.Random(SEED), 0
    for i in range(RUNS):
        sig, delay = rng.choice([signal.SIGINT, signal.SIGTERM]), rng.uniform(0.0, 2.5)
        out = tmp_path / f"run{i}"
        out.mkdir()
        result = _signal_at_random("convert", [str(K3_TINY), str(out / "o.gguf"), "--quiet"], tmp_path / f"m{i}",
                                   delay, sig)
        moment = f"seed {SEED}, run {i}: {signal.Signals(sig).name} {delay:.3f} s in"
        if result is None:
            continue
        stopped += 1
        _check(result, sig, moment)
        left = sorted(p.name for p in out.iterdir())
        assert not [n for n in left if n.endswith(".partial")], (moment, left)
        assert left in ([], ["o.gguf", "o.gguf.sha256.json"]), (moment, left)  # nothing, or all of it
    assert stopped >= RUNS // 2, f"only {stopped} of {RUNS} runs were still going when signalled"


def test_generations_stopped_at_random_moments_always_end_as_documented(tmp_path, k3_tiny_gguf, cpu_hog):
    rng, stopped = random.Random(SEED + 1), 0
    args = ["-m", str(k3_tiny_gguf), "-p", "[BOS]The old woman", "-n", "100000", "--ignore-eos", "-c", "4096",
            "-t", "1"]
    for i in range(RUNS):
        sig, delay = rng.choice([signal.SIGINT, signal.SIGTERM]), rng.uniform(0.0, 3.0)
        result = _signal_at_random("cli", args, tmp_path / f"m{i}", delay, sig)
        if result is not None:
            stopped += 1
            _check(result, sig, f"seed {SEED + 1}, run {i}: {signal.Signals(sig).name} {delay:.3f} s in")
    assert stopped >= RUNS // 2, f"only {stopped} of {RUNS} runs were still going when signalled"
