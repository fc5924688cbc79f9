"""kimi-k3-cli on a pseudo-terminal, as a user at a terminal runs it: stdin and stdout are the
terminal (its controlling terminal: Ctrl-C typed there is the kernel's SIGINT to the program),
stderr goes to a file.

Every wait is for a state of the output (the Nth prompt, a text), never for a time; the limits
only turn a hang into a failure. Lines typed are echoed by the terminal, as a user sees them, and
the output's CRLF line ends are read back as LF.
"""
from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Callable

from tests.support.paths import REPO

LIMIT_S = 120.0  # a wait longer than this is a hang


def _take_terminal() -> None:
    # In the child, after setsid (start_new_session): stdin, the pty, becomes its controlling
    # terminal, so the line discipline sends it SIGINT for a typed Ctrl-C.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class PtyRun:
    """One run of `python -m ggml_graph_spec ARGS` on a fresh pseudo-terminal."""

    def __init__(self, args: list[str], stderr: Path) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.stderr = stderr
        with open(stderr, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "ggml_graph_spec", *map(str, args)], cwd=REPO,
                                         stdin=slave, stdout=slave, stderr=err, start_new_session=True,
                                         preexec_fn=_take_terminal)
        os.close(slave)
        self._master: int | None = master
        self._seen = b""
        self._lines = 0  # lines typed

    @property
    def output(self) -> str:
        """What the terminal showed so far (the program's stdout and the echoed input)."""
        return self._seen.decode("utf-8", "replace").replace("\r\n", "\n")

    def err(self) -> str:
        return self.stderr.read_text(encoding="utf-8", errors="replace")

    def _pump(self, deadline: float) -> bool:
        """Read what the terminal has; False once the program closed it."""
        left = deadline - time.monotonic()
        assert left > 0, f"no progress within {LIMIT_S} s; the terminal shows:\n{self.output}\nstderr:\n{self.err()}"
        if not select.select([self._master], [], [], min(left, 1.0))[0]:
            return True
        try:
            chunk = os.read(self._master, 65536)
        except OSError:  # EIO: every writer of the terminal is gone
            return False
        self._seen += chunk
        return bool(chunk)

    def wait_for(self, done: Callable[[str], bool], limit_s: float = LIMIT_S) -> str:
        """The output once done(output) holds."""
        deadline = time.monotonic() + limit_s
        while not done(self.output):
            assert self._pump(deadline), f"the program ended first; the terminal shows:\n{self.output}\n" \
                                         f"stderr:\n{self.err()}"
        return self.output

    def prompts(self) -> int:
        return prompts(self.output)

    def wait_prompt(self, n: int) -> str:
        """The output once the Nth `> ` prompt is shown (the program then waits for input)."""
        return self.wait_for(lambda s: prompts(s) >= n)

    def type(self, text: str) -> None:
        os.write(self._master, text.encode("utf-8"))

    def line(self, text: str) -> str:
        """Type a line and Enter at the next prompt (each line typed answers one prompt); the output
        up to that prompt."""
        shown = self.wait_prompt(self._lines + 1)
        self._lines += 1
        self.type(text + "\n")
        return shown

    def ctrl_c(self) -> None:
        self.type("\x03")

    def wait(self, limit_s: float = LIMIT_S) -> int:
        """The exit code, once the program ended (its output read to the end)."""
        deadline = time.monotonic() + limit_s
        while self._pump(deadline):
            pass
        return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self._master is not None:
            os.close(self._master)
            self._master = None


def prompts(output: str) -> int:
    """The `> ` prompts shown (each starts a line)."""
    return sum(1 for line in output.split("\n") if line.startswith("> "))
