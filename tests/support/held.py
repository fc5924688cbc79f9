"""A conversion held in the middle of its writes until a test has signalled it: what makes a
"Ctrl-C mid-write" test deterministic on a loaded machine.

The prelude makes the n-th tensor's reads wait for a writer on a FIFO and leaves a marker file
when they do; `interrupt_mid_write` waits for the marker, sends the signal, then opens the FIFO
so the conversion goes on and meets the signal at its next chunk (signals.deferred).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.support.cli import start_cli

HELD_AT_TENSOR = """
import os
from pathlib import Path
import gguf_arch.convert.run as m
_real, _n = m.tensor_chunks, [0]
def held(*a):
    _n[0] += 1
    if _n[0] == {n}:
        Path({marker!r}).touch()
        os.close(os.open({fifo!r}, os.O_RDONLY))
    return _real(*a)
m.tensor_chunks = held
"""


def interrupt_mid_write(ctl: Path, *args: str | Path, sig: int = signal.SIGINT, at_tensor: int = 5,
                        timeout: float = 300) -> tuple[int, str]:
    """Convert with `args`, signal it while its `at_tensor`-th tensor is being read; (exit code,
    stderr). `ctl` is an empty directory outside the output's, for the FIFO and the marker."""
    fifo, marker = ctl / "go", ctl / "held"
    os.mkfifo(fifo)
    proc = start_cli(*args, prelude=HELD_AT_TENSOR.format(n=at_tensor, marker=str(marker), fifo=str(fifo)))
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the conversion never reached the held tensor"
            time.sleep(0.01)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(sig)
        os.close(os.open(fifo, os.O_WRONLY))  # let it go on: it stops at its next chunk
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err
