"""scripts/setup_step.sh: a setup step says what it builds, and on failure shows why."""
from __future__ import annotations

import subprocess

from tests.support.paths import REPO


def _step(tmp_path, command: str) -> subprocess.CompletedProcess:
    script = f'set -euo pipefail; LOGS="{tmp_path}"; source scripts/setup_step.sh; ' \
             f'setup_step demo "building the demo (seconds)" -- bash -c {command!r}; echo after'
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_step_announces_itself_and_keeps_its_output_in_the_log(tmp_path):
    run = _step(tmp_path, "echo compiler chatter")
    assert run.returncode == 0
    assert run.stderr.startswith("setup: building the demo (seconds)\n")
    assert "setup:   done in " in run.stderr and "compiler chatter" not in run.stderr + run.stdout
    assert run.stdout == "after\n"
    assert (tmp_path / "demo.log").read_text() == "compiler chatter\n"


def test_a_failed_step_prints_one_error_line_and_the_tail_of_its_log(tmp_path):
    run = _step(tmp_path, "for i in $(seq 1 100); do echo line $i; done; exit 3")
    assert run.returncode == 3 and "after" not in run.stdout
    err = run.stderr.splitlines()
    failed = [line for line in err if line.startswith("error: ")]
    assert failed == [f"error: setup step 'demo' failed (exit 3); last lines of {tmp_path}/demo.log:"]
    assert err[-30:] == [f"line {i}" for i in range(71, 101)]
