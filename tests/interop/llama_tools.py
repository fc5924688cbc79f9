"""Where the tests find llama.cpp's own command-line tools, and how they run them.

scripts/setup_env.sh builds the tools once per machine (scripts/build_llama_tools.sh) and exports
their directory as KIMI_K3_LLAMA_BIN; nothing is built or downloaded at test time. When the
tools are not there, a test that needs them fails under CI=true (a CI run must exercise them)
and is skipped with the reason otherwise (a bare `pytest` outside the README's setup).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from quant_rules.llama_quantize import LLAMA_BIN_ENV

TOOLS = ("llama-cli", "llama-completion", "llama-perplexity", "llama-imatrix", "llama-quantize", "llama-gguf-split")
# A whole tool run on the test models takes seconds; a hang must not stall the suite.
TIMEOUT_S = 300


def _problem() -> str:
    where = os.environ.get(LLAMA_BIN_ENV)
    if not where:
        return f"{LLAMA_BIN_ENV} is not set: run the tests through scripts/test.sh, which builds llama.cpp's tools"
    missing = [t for t in TOOLS if not os.access(Path(where) / t, os.X_OK)]
    if missing:
        return f"{LLAMA_BIN_ENV}={where} lacks {', '.join(missing)}: rerun scripts/setup_env.sh"
    return ""


def llama_bin() -> Path:
    """The tools' directory; fails the calling test under CI=true when absent, else skips it."""
    problem = _problem()
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"llama.cpp tools required under CI=true: {problem}")
        pytest.skip(problem)
    return Path(os.environ[LLAMA_BIN_ENV])


def run_tool(tool: str, *args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run one tool to completion; a failure shows the end of its log."""
    cmd = [str(llama_bin() / tool), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=TIMEOUT_S, cwd=cwd,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{tool} exited with {r.returncode}: {r.stderr[-3000:]}"
    return r
