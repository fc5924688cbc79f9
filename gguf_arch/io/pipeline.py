"""Overlapping the conversion's stages on threads: numpy's nibble work, hashlib on large buffers
and file writes all release the GIL, so each can run while the caller produces the next chunk.
Both helpers bound the work in flight, so memory stays a few chunks whatever the model's size."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ahead(fn: Callable[[T], R], items: Iterable[T], depth: int) -> Iterator[R]:
    """fn(item) for each item, in order, with at most `depth` of them computed ahead on threads."""
    with ThreadPoolExecutor(depth) as pool:
        pending: deque[Future[R]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) == depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class SerialWorker:
    """One thread running the submitted calls in submission order, at most `depth` of them
    unfinished: `submit` waits for the oldest when more are pending, and re-raises its error."""

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self._pending: deque[Future] = deque()
        self._pool = ThreadPoolExecutor(1)

    def __enter__(self) -> "SerialWorker":
        return self

    def __exit__(self, *exc_info) -> None:
        self._pool.shutdown(wait=True)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._pending.append(self._pool.submit(fn, *args))
        while len(self._pending) > self._depth:
            self._pending.popleft().result()

    def drain(self) -> None:
        """Wait for every submitted call (re-raising the first error)."""
        while self._pending:
            self._pending.popleft().result()
