"""pipeline.SerialWorker, the writer thread and the hashing thread of a conversion: calls run in
submission order, the caller never gets more than `depth` ahead, and a failed call is re-raised.
pipeline.Lookahead, the next tensor produced while the current one is written: order kept,
errors raised where their item is consumed, no thread left running."""
from __future__ import annotations

import threading
import time

import pytest

from gguf_arch.io.pipeline import Lookahead, SerialWorker


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


def _produce_log(log: list):
    def produce(item):
        for k in range(3):
            log.append((item, k, threading.current_thread().name))
            yield (item, k)
    return produce


def test_lookahead_yields_every_item_in_order_and_runs_the_next_one_ahead():
    log: list = []
    look = Lookahead(_produce_log(log), ["a", "b", "c"])
    out = [list(look(item)) for item in ["a", "b", "c"]]
    look.close()
    assert out == [[(i, k) for k in range(3)] for i in "abc"]
    assert {name for i, _, name in log if i in "bc"} == {"kimi-k3-lookahead"}  # produced on the thread
    assert not any(t.name == "kimi-k3-lookahead" and t.is_alive() for t in threading.enumerate())


def test_lookahead_out_of_order_is_produced_inline_and_abandons_the_item_ahead():
    log: list = []
    look = Lookahead(_produce_log(log), ["a", "b", "c"])
    assert list(look("a")) == [("a", k) for k in range(3)]
    assert list(look("c")) == [("c", k) for k in range(3)]  # "b" was ahead: stopped, not yielded
    assert {name for i, _, name in log if i == "c"} == {threading.current_thread().name}
    look.close()
    assert not any(t.name == "kimi-k3-lookahead" and t.is_alive() for t in threading.enumerate())


def test_an_error_of_the_item_ahead_is_raised_when_that_item_is_consumed():
    def produce(item):
        yield item
        if item == "b":
            raise ValueError("bad b")
    look = Lookahead(produce, ["a", "b"])
    assert list(look("a")) == ["a"]
    it = look("b")
    assert next(it) == "b"
    with pytest.raises(ValueError, match="bad b"):
        next(it)
    look.close()


def test_close_stops_an_item_left_half_consumed():
    started = threading.Event()

    def endless(item):
        while True:
            started.set()
            yield item
    look = Lookahead(endless, ["a", "b"])
    it = look("a")
    assert next(it) == "a"
    started.wait(5)
    look.close()  # "a" half consumed, "b" ahead: both threads end
    assert not any(t.name == "kimi-k3-lookahead" and t.is_alive() for t in threading.enumerate())


def test_an_item_that_fails_before_its_first_value_is_an_error_not_a_hang():
    def produce(item):
        if item == "b":
            raise ValueError("b refused at once")  # not a generator: fails when called
        return iter([item])
    look = Lookahead(produce, ["a", "b"])
    assert list(look("a")) == ["a"]
    with pytest.raises(ValueError, match="refused at once"):
        list(look("b"))
    look.close()
