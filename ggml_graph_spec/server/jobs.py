"""A request on its way through the engine, and what comes back from it.

The engine thread owns the model; an HTTP handler owns its job's asyncio queue. The engine posts
to that queue through the handler's event loop (`call_soon_threadsafe`), so it never waits for a
client: a client that reads slowly, or not at all, holds up nobody but itself.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field

from ..generation.events import TokenEvent
from .errors import ApiError
from .protocol import GenRequest

_ids = itertools.count()

# How a generation's stop reason (generation/events.py) reads in OpenAI's finish_reason.
FINISH_REASONS = {"eog": "stop", "reverse prompt": "stop", "n_predict": "length", "context": "length",
                  "cancelled": "cancelled"}


@dataclass
class Result:
    """The end of a job: why, and the counts `usage` and `timings` report."""

    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_ms: float
    predicted_ms: float
    slot: int

    def timings(self) -> dict:
        """llama-server's `timings` object."""
        fresh = self.prompt_tokens - self.cached_tokens
        return {"cache_n": self.cached_tokens, "prompt_n": fresh, "prompt_ms": self.prompt_ms,
                "prompt_per_second": _rate(fresh, self.prompt_ms),
                "predicted_n": self.completion_tokens, "predicted_ms": self.predicted_ms,
                "predicted_per_second": _rate(self.completion_tokens, self.predicted_ms)}


def _rate(n: int, ms: float) -> float:
    return n / ms * 1e3 if ms > 0 else 0.0


@dataclass(eq=False)
class Job:
    request: GenRequest
    loop: asyncio.AbstractEventLoop
    id: int = field(default_factory=lambda: next(_ids))
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel_requested: threading.Event = field(default_factory=threading.Event)
    # Set by the engine thread.
    slot: int = -1
    cached: int = 0
    tokens: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    parser: object | None = None  # chat/reply.ReplyParser of a chat reply
    constraint: object | None = None  # chat/constraint.Constraint

    def _post(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed: nobody is listening any more
            pass

    def started(self, slot: int, cached: int) -> None:
        self.slot, self.cached, self.t_start = slot, cached, time.perf_counter()

    def token(self, event: TokenEvent) -> None:
        if not self.tokens:
            self.t_first = time.perf_counter()
        self.tokens += 1
        self._post(("token", (event, self.parser.take() if self.parser is not None else [])))

    def end(self, reason: str) -> Result:
        now = time.perf_counter()
        if self.parser is not None:  # the reply's last deltas (text a decoder held back)
            self.parser.finish()
            tail = self.parser.take()
            if tail:
                self._post(("token", (TokenEvent(None, ""), tail)))
        first = self.t_first or now
        result = Result(FINISH_REASONS.get(reason, reason), len(self.request.prompt), self.cached, self.tokens,
                        (first - self.t_start) * 1e3 if self.t_start else 0.0, (now - first) * 1e3, self.slot)
        self._post(("end", result))
        return result

    def fail(self, error: ApiError) -> None:
        self._post(("error", error))
