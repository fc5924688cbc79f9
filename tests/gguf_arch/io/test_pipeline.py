"""pipeline.SerialWorker, the writer thread and the hashing thread of a conversion: calls run in
submission order, the caller never gets more than `depth` ahead, and a failed call is re-raised."""
from __future__ import annotations

import threading
import time

import pytest

from gguf_arch.io.pipeline import SerialWorker


def test_calls_run_in_order_and_the_caller_stays_at_most_depth_ahead():
    done: list[int] = []
    submitted = 0

    def work(i: int) -> None:
        time.sleep(0.001 * (5 - i % 5))
        # the calls not yet finished are those submitted after the last one done
        assert submitted - len(done) <= 3
        done.append(i)

    with SerialWorker(2) as w:
        for i in range(20):
            submitted += 1
            w.submit(work, i)
            assert submitted - len(done) <= 3  # at most depth (2) pending plus the one running
        w.drain()
    assert done == list(range(20))


def test_one_thread_runs_every_call():
    threads = set()
    with SerialWorker(4) as w:
        for _ in range(10):
            w.submit(lambda: threads.add(threading.get_ident()))
        w.drain()
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_a_failed_call_is_raised_to_the_caller():
    def fail() -> None:
        raise OSError("disk full")

    with SerialWorker(1) as w:
        w.submit(fail)
        with pytest.raises(OSError, match="disk full"):
            w.submit(lambda: None)
            w.submit(lambda: None)
            w.drain()
