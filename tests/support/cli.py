"""Run convert_kimi_k3.py, or any other tool of the project, in a fresh interpreter (optionally
with faults set up in that process) and check the documented contract: exit code, exactly one
`error: ` line, nothing under OUT."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import REPO


@dataclass
class Result:
    rc: int
    out: str
    err: str

    def one_error_line(self, code: int, *needles: str) -> str:
        assert self.rc == code, (self.rc, self.err)
        assert self.err.startswith("error: ") and self.err.count("\n") == 1, self.err
        for needle in needles:
            assert needle in self.err, self.err
        return self.err


# The project's command-line tools, by the module whose main() each test runs.
MODULES = {"convert": "convert_kimi_k3", "cli": "ggml_graph_spec.runner.cli", "diff": "gguf_arch.verify.diff",
           "synth": "gguf_arch.synth.cli", "quantize": "kimi_k3_quantize", "calibrate": "ggml_graph_spec.tools.calibrate",
           "prune": "ggml_graph_spec.tools.prune", "doctor": "ggml_graph_spec.tools.doctor",
           "rpc-server": "ggml_graph_spec.tools.rpc_server",
           "encode-images": "ggml_graph_spec.tools.encode_images", "server": "ggml_graph_spec.server.cli"}
# Any ggml context or weight buffer made in the child ends it with exit 99: a value reached ggml
# before it was checked.
NO_GGML = ("import os, ggml\n"
           "def _trip(*a, **k):\n    os._exit(99)\n"
           "ggml.ggml_init = ggml.ggml_backend_cpu_buffer_from_ptr = _trip\n")


def tool_code(tool: str, prelude: str = "") -> str:
    """`prelude` is Python run in the child before main(): how a test injects a fault there."""
    return f"import sys\n{prelude}\nimport {MODULES[tool]} as m\nsys.exit(m.main(sys.argv[1:]))"


def run_tool(tool: str, *args: str | Path, prelude: str = "", preexec=None, timeout: float = 120) -> Result:
    """One of the tools in a fresh interpreter, no stdin; the timeout turns a hang into a failure."""
    res = subprocess.run([sys.executable, "-c", tool_code(tool, prelude), *map(str, args)], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout, preexec_fn=preexec,
                         stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return Result(res.returncode, res.stdout, res.stderr)


def run_cli(*args: str | Path, prelude: str = "", preexec=None, timeout: float = 120) -> Result:
    """convert_kimi_k3.py in a fresh interpreter."""
    return run_tool("convert", *args, prelude=prelude, preexec=preexec, timeout=timeout)


def start_cli(*args: str | Path, prelude: str = "") -> subprocess.Popen:
    return start_tool("convert", *args, prelude=prelude)


def start_tool(tool: str, *args: str | Path, prelude: str = "") -> subprocess.Popen:
    """One of the tools in a fresh interpreter, running: for a test that signals it."""
    return subprocess.Popen([sys.executable, "-c", tool_code(tool, prelude), *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)


# VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so a child of a pytest that has
# grown to 1 GB would report pytest's peak.
PEAK_RSS_PRELUDE = ("import atexit, re\natexit.register(lambda: print('vmhwm_kib', re.search("
                    "r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]))")


def peak_rss_kib(*args: str | Path, timeout: float = 300) -> int:
    """Run convert_kimi_k3.py with `args` in a fresh interpreter (it must succeed): its peak RSS in KiB."""
    res = run_cli(*args, prelude=PEAK_RSS_PRELUDE, timeout=timeout)
    assert res.rc == 0, res.err
    return int(re.search(r"vmhwm_kib (\d+)", res.out)[1])


def run_runner(*argv: str | Path, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """kimi-k3-cli (`python -m ggml_graph_spec`) in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "ggml_graph_spec", *map(str, argv)], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=timeout)
