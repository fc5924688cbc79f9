"""scripts/demo.sh, the README's main job: generate, convert, inspect; twice in a row."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

DEMO = REPO / "scripts" / "demo.sh"


def _setup_done() -> bool:
    # demo.sh sources setup_env.sh, which installs into .venv unless its stamp is current;
    # scripts/test.sh (README, CI) sources it too and exports the stamp's path.
    stamp = os.environ.get("KIMI_K3_VENV_STAMP")
    return stamp is not None and Path(stamp).exists()


@pytest.mark.skipif(not _setup_done(), reason=".venv not set up by scripts/setup_env.sh (run via scripts/test.sh)")
def test_demo_generates_converts_and_inspects_idempotently(tmp_path):
    runs = [subprocess.run(["bash", str(DEMO), str(tmp_path)], capture_output=True, text=True) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    out = runs[1].stdout
    assert "architecture: kimi-k3" in out and "tensors: 369 " in out
    assert "kimi-k3.attention.indexer.types = arr[bool, 13], true on layers [3, 7, 11, 12]" in out
    assert "indexer.proj.weight F32" in out and "indexer.k_norm.weight F32" in out
    assert (tmp_path / "tiny.gguf").stat().st_size > 0
