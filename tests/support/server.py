"""kimi-k3-server in the test's own process: the same argument parsing, load, app and engine thread
as the command, on a loopback port chosen by the kernel, with a gate on the model's decode calls so
that a test decides when each engine step may run (no timing windows)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

from ggml_graph_spec.runner.args import load_options
from ggml_graph_spec.runner.cli import load
from ggml_graph_spec.server.app import Server
from ggml_graph_spec.server.cli import build_parser, check, http_settings, start_engine
from ggml_graph_spec.server.service import Service, bind

WAIT_S = 120.0  # the longest any wait of a test may take before it fails loudly


class Gate:
    """Wraps Model.decode: while closed, each call waits for a permit (`step`) first."""

    def __init__(self, model) -> None:
        self._decode = model.decode
        model.decode = self._gated
        self._open = threading.Event()
        self._open.set()
        self._permits = threading.Semaphore(0)
        self.waiting = threading.Event()  # set when a call waits at the closed gate
        self.fail_next: BaseException | None = None  # raised by the next call instead of decoding

    def close(self) -> None:
        self._open.clear()
        while self._permits.acquire(blocking=False):  # open()'s spare permits: closed means closed
            pass

    def open(self) -> None:
        self._open.set()
        self._permits.release(1000)

    def step(self, n: int = 1) -> None:
        self._permits.release(n)

    def _gated(self, *args, **kwargs):
        if not self._open.is_set():
            self.waiting.set()
            if not self._permits.acquire(timeout=WAIT_S):
                raise RuntimeError(f"test gate: no permit for {WAIT_S} s")
            self.waiting.clear()
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        return self._decode(*args, **kwargs)


def wait_for(condition, what: str, timeout: float = WAIT_S) -> None:
    """Wait until condition() holds (it reads the server's state); fail loudly after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class LiveServer:
    """`http`: HttpSettings fields to override (limits a flag does not set: max_requests,
    max_connections, header_timeout)."""

    def __init__(self, gguf: Path, *argv: str, http: dict | None = None) -> None:
        self.log: list[str] = []
        a = build_parser().parse_args(["-m", str(gguf), "-t", "2", *map(str, argv)])
        check(a)
        self.args = a
        self.model = load(a.model, load_options(a, n_seq=a.parallel, n_batch=a.batch_size))
        self.gate = Gate(self.model)
        settings = replace(http_settings(a), **(http or {}))
        self.service = Service(Server(settings, self.log.append), bind("127.0.0.1", 0))
        self.engine = start_engine(self.model, self.service, a)
        self.url = self.service.address
        self.http = httpx.Client(base_url=self.url, timeout=WAIT_S)

    def slots(self) -> list[dict]:
        return self.http.get("/slots").json()

    def idle(self) -> bool:
        return not any(s["is_processing"] for s in self.slots()) and self.engine.deferred == 0

    def tracebacks(self) -> list[str]:
        """The server's log lines that are not one line: a traceback, or anything multi-line."""
        return [line for line in self.log if "\n" in line or "Traceback" in line]

    def close(self) -> None:
        self.gate.open()
        self.http.close()
        try:
            assert self.service.stop(), "the HTTP server did not stop"
        finally:
            if self.service.server.vision is not None:
                self.service.server.vision.close()
            self.model.close()


class LogRecords(logging.Handler):
    """Every record of uvicorn's, asyncio's and the root logger at WARNING or above, while
    installed: what the server process would print to stderr besides its own log lines
    (uvicorn's loggers do not propagate to the root, so caplog alone misses them)."""

    NAMES = ("uvicorn", "")  # uvicorn.error propagates to uvicorn, asyncio to the root

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "LogRecords":
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *_exc) -> None:
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)

    def tracebacks(self) -> list[str]:
        """The records that carry a traceback or span lines (a warning of one line is no fault)."""
        return [line for r, line in zip(self.records, self.lines()) if r.exc_info or "\n" in line]

    def lines(self) -> list[str]:
        """Each record as it would print, its traceback included."""
        return [logging.Formatter("%(name)s %(levelname)s %(message)s").format(r) for r in self.records]
