"""Ctrl-C while a reply streams: the first one ends the reply after the current token (the
caches then hold exactly what was evaluated), a second one ends the program at once, and so does
the first if the ggml call under way has not returned within signals.GRACE_S (a server gone
silent). Handled where every stop signal is: gguf_arch/errors/signals.py."""
from __future__ import annotations

from gguf_arch.errors.signals import Graceful as Interrupt
from gguf_arch.errors.signals import graceful_sigint as sigint_stops

__all__ = ["Interrupt", "sigint_stops"]
