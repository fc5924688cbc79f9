"""Run any CLI of this project in a fresh interpreter with a timeout (a hang fails the test, it
never blocks the suite), optionally after a prelude: how a test injects a fault or a tripwire."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.cli import Result
from tests.support.paths import REPO

MODULES = {"convert": "convert_kimi_k3", "cli": "ggml_graph_spec.cli", "diff": "gguf_arch.verify.diff",
           "synth": "gguf_arch.synth.cli"}
# Any ggml context or weight buffer made in the child ends it with exit 99: the value reached ggml
# before it was checked.
NO_GGML = ("import os, ggml\n"
           "def _trip(*a, **k):\n    os._exit(99)\n"
           "ggml.ggml_init = ggml.ggml_backend_cpu_buffer_from_ptr = _trip\n")


def tool_code(tool: str, prelude: str = "") -> str:
    return f"import sys\n{prelude}\nimport {MODULES[tool]} as m\nsys.exit(m.main(sys.argv[1:]))"


def run_tool(tool: str, *args: str | Path, prelude: str = "", timeout: float = 120, preexec=None) -> Result:
    res = subprocess.run([sys.executable, "-c", tool_code(tool, prelude), *map(str, args)], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout, preexec_fn=preexec,
                         stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return Result(res.returncode, res.stdout, res.stderr)
