"""Run convert_kimi_k3.py in a fresh interpreter (optionally with faults set up in that process)
and check the documented contract: exit code, exactly one `error: ` line, nothing under OUT."""
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


def run_cli(*args: str | Path, prelude: str = "", preexec=None, timeout: float = 120) -> Result:
    """`prelude` is Python run in the child before main(): how a test injects a fault there."""
    code = f"import sys\n{prelude}\nimport convert_kimi_k3\nsys.exit(convert_kimi_k3.main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout, preexec_fn=preexec, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return Result(res.returncode, res.stdout, res.stderr)


def start_cli(*args: str | Path, prelude: str = "") -> subprocess.Popen:
    code = f"import sys\n{prelude}\nimport convert_kimi_k3\nsys.exit(convert_kimi_k3.main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


# VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so a child of a pytest that has
# grown to 1 GB would report pytest's peak.
PEAK_RSS_PRELUDE = ("import atexit, re\natexit.register(lambda: print('vmhwm_kib', re.search("
                    "r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]))")


def peak_rss_kib(*args: str | Path, timeout: float = 300) -> int:
    """Run convert_kimi_k3.py with `args` in a fresh interpreter (it must succeed): its peak RSS in KiB."""
    res = run_cli(*args, prelude=PEAK_RSS_PRELUDE, timeout=timeout)
    assert res.rc == 0, res.err
    return int(re.search(r"vmhwm_kib (\d+)", res.out)[1])
