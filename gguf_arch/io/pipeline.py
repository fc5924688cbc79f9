"""Overlapping the conversion's stages on threads: numpy's nibble work, hashlib on large buffers
and file writes all release the GIL, so each can run while the caller produces the next chunk.
Both helpers bound the work in flight, so memory stays a few chunks whatever the model's size."""
from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
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
        self.close()

    def close(self) -> None:
        """Stop the thread once the submitted calls have run (their errors are not raised here)."""
        self._pool.shutdown(wait=True)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._pending.append(self._pool.submit(fn, *args))
        while len(self._pending) > self._depth:
            self._pending.popleft().result()

    def drain(self) -> None:
        """Wait for every submitted call (re-raising the first error)."""
        while self._pending:
            self._pending.popleft().result()


_END = object()


class Lookahead:
    """`produce(item)` for items requested in `order`, the next item's iterator already running
    on a thread while the current one is consumed, so a stage that ends per item (a tensor's
    last read, its scan) does not leave the disk idle until the next item's first read.

    At most one item is ahead, at most `depth` of its values queued. An item asked for out of
    order is produced in the caller's thread (and any item ahead is abandoned); an error of an
    item ahead is raised when that item is consumed, as it would have been without the look-ahead.
    """

    def __init__(self, produce: Callable[[T], Iterable[R]], order: Iterable[T], depth: int = 1) -> None:
        self._produce, self._order, self._depth = produce, list(order), depth
        self._next = 0  # index in `order` of the item expected next
        self._ahead: tuple[int, "_Background"] | None = None
        self._current: "_Background | None" = None

    def __call__(self, item: T) -> Iterator[R]:
        i = self._next if self._next < len(self._order) and self._order[self._next] == item else None
        self._current = running = self._take(i)
        self._next = i + 1 if i is not None else len(self._order)
        if i is not None and self._next < len(self._order):
            self._ahead = (self._next, _Background(self._produce, self._order[self._next], self._depth))
        return iter(running) if running is not None else iter(self._produce(item))

    def _take(self, i: int | None) -> "_Background | None":
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == i:
            return ahead[1]
        if ahead is not None:
            ahead[1].cancel()
        return None

    def close(self) -> None:
        """Stop the threads of the items ahead and being consumed (after an error, or when the
        caller stops early; after the last item there is nothing left to stop)."""
        self._take(None)
        if self._current is not None:
            self._current.cancel()
            self._current = None


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class _Background:
    """One item's values produced on a thread into a bounded queue; iterate to consume them.
    Leaving the iteration early (an error downstream) or `cancel` stops the thread."""

    def __init__(self, produce: Callable[[T], Iterable[R]], item: T, depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(produce, item), daemon=True,
                                        name="kimi-k3-lookahead")
        self._thread.start()

    def _run(self, produce, item) -> None:
        values = None
        try:
            values = iter(produce(item))  # may fail before the first value, as a check of `item`
            for value in values:
                if not self._put(value):
                    return
        except BaseException as exc:  # handed to the consumer, raised where the item is consumed
            self._put(_Failed(exc))
            return
        finally:
            getattr(values, "close", lambda: None)()  # its own threads and buffers, now
        self._put(_END)

    def _put(self, value) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator:
        try:
            while True:
                value = self._queue.get()
                if value is _END:
                    return
                if isinstance(value, _Failed):
                    raise value.error
                yield value
        finally:
            self.cancel()

    def cancel(self) -> None:
        self._stop.set()
        self._thread.join()
