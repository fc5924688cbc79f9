"""A long-lived child process that opens GGUF files as the runner does, one path per stdin line.

Run in a subprocess because a ggml assert aborts the whole process: the parent sees the child die
instead of a reply, and names the file. Each reply is one JSON line: the outcome of
`Model.load` (the loader's validation) and, if the file was accepted, of one forward pass.
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HANG_SECONDS = 60  # a tiny model loads and runs a token in well under a second


def _outcome(path: str) -> dict:
    from gguf_arch.errors import KimiError
    from ggml_graph_spec.engine.model import Model
    try:
        model = Model.load(path, n_ctx=4, n_threads=1)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which judges it
        return {"loaded": False, "kimi": isinstance(exc, KimiError), "type": type(exc).__name__, "msg": str(exc)}
    try:
        model.eval([1, 2])
        return {"loaded": True}
    except Exception as exc:  # noqa: BLE001
        return {"loaded": True, "kimi": isinstance(exc, KimiError), "type": type(exc).__name__, "msg": str(exc)}
    finally:
        model.close()


def serve() -> None:
    for line in sys.stdin:
        print(json.dumps(_outcome(line.rstrip("\n"))), flush=True)


class Worker:
    """The parent's handle: `check(path)` returns the child's reply, {"died": returncode}, or
    {"hung": seconds} (the child is then killed)."""

    def __init__(self, code: str = "from tests.fuzz.gguf_worker import serve; serve()") -> None:
        self._code = code
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", self._code],
                                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)

    def check(self, path: Path) -> dict:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        self._proc.stdin.write(f"{path}\n")
        self._proc.stdin.flush()
        if not select.select([self._proc.stdout], [], [], HANG_SECONDS)[0]:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            return {"hung": HANG_SECONDS}
        reply = self._proc.stdout.readline()
        if not reply:
            rc = self._proc.wait(timeout=30)
            self._proc = None
            return {"died": rc}
        return json.loads(reply)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
            self._proc = None
