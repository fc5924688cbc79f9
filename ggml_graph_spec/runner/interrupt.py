"""Ctrl-C while a reply streams: the first one ends the reply after the current token (the
caches then hold exactly what was evaluated), a second one ends the program at once."""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class Interrupt:
    """Set by the first Ctrl-C while generating; a second one raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.requested = False

    def _handler(self, _signum: int, _frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


@contextlib.contextmanager
def sigint_stops() -> Iterator[Interrupt]:
    """While inside, Ctrl-C asks the generation loop to stop instead of raising KeyboardInterrupt."""
    interrupt = Interrupt()
    previous = signal.signal(signal.SIGINT, interrupt._handler)
    try:
        yield interrupt
    finally:
        signal.signal(signal.SIGINT, previous)
