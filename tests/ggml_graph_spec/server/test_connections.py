"""Connection-level faults: a body that never finishes or whose client goes away, Content-Length
lies, what h11 cannot parse, slow headers, more connections and more requests than the server
takes. Each is an OpenAI error object or nothing, never a traceback (the server's log lines and
uvicorn's and asyncio's logging both checked), never a queued job; the server serves on.

Raw sockets speak the HTTP; h11's client side reads the answers. Where an outcome waits on a
deadline (the header deadline, --timeout), the test waits for the outcome, not for a time."""
from __future__ import annotations

import contextlib
import json
import socket
import threading

import h11
import httpx
import pytest

from tests.support.server import WAIT_S, LiveServer, LogRecords, wait_for

GOOD = {"prompt": "The old woman sold", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(k3_tiny_gguf):
    s = LiveServer(k3_tiny_gguf, "-np", 2, "--queue", 8, "-c", 2 * 256, "--timeout", 2,
                   http={"header_timeout": 1.0, "max_connections": 8})
    yield s
    s.close()


@pytest.fixture
def logs(server):
    with LogRecords() as records:
        yield records
    assert not records.tracebacks() and not server.tracebacks(), (records.tracebacks(), server.tracebacks())
    wait_for(server.idle, "every slot free")
    assert server.http.post("/v1/completions", json=GOOD).status_code == 200


def _connect(server) -> socket.socket:
    s = socket.create_connection(server.service.sock.getsockname()[:2], timeout=WAIT_S)
    return s


def _answers(sock: socket.socket, n: int) -> list[tuple[h11.Response | None, bytes]]:
    """The first n responses the server sends on this connection (None: it closed without one)."""
    conn, out = h11.Connection(h11.CLIENT), []
    while len(out) < n:
        conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))  # h11's client needs a request
        conn.send(h11.EndOfMessage())
        response, body = _read(sock, conn)
        out.append((response, body))
        if response is None or conn.their_state is not h11.DONE:
            break
        conn.start_next_cycle()
    return out


def _read(sock: socket.socket, conn: h11.Connection) -> tuple[h11.Response | None, bytes]:
    response, body = None, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            conn.receive_data(data)
            if not data and response is None:
                return None, b""
            continue
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return response, body


def _answer(sock: socket.socket) -> tuple[h11.Response | None, bytes]:
    return _answers(sock, 1)[0]


def _error(response: h11.Response | None, body: bytes, status: int) -> dict:
    assert response is not None and response.status_code == status, (response, body)
    headers = {k.decode().lower(): v.decode() for k, v in response.headers}
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == status and "\n" not in error["message"]
    return {**error, "headers": headers}


def _head(body_length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body_length}\r\n\r\n").encode()


def test_a_client_gone_mid_body_leaves_nothing_queued_and_nothing_logged(server, logs):
    taken, lines = server.engine.stats.requests, len(server.log)
    with _connect(server) as s:
        s.sendall(_head(1000) + b'{"prompt": "x", ')
    # the next request on another connection is answered after the gone one was handled
    wait_for(lambda: server.service._uvicorn.server_state.connections.__len__() == 0, "the connection to close")
    assert server.http.post("/tokenize", json={"content": "x"}).status_code == 200
    assert server.engine.stats.requests == taken and server.log[lines:] == []


def test_a_body_shorter_than_its_content_length_is_a_408_after_the_timeout(server, logs):
    with _connect(server) as s:
        s.sendall(_head(1000) + b'{"prompt": "x"}')
        error = _error(*_answer(s), 408)
    assert error["message"] == "the request body did not arrive within 2 s (--timeout)"


@pytest.mark.parametrize("raw, status, needle", [
    (_head(len(json.dumps(GOOD)) - 5) + json.dumps(GOOD).encode(), 400, "the request body is not valid JSON"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n{}", 400, "not a valid HTTP request"),
    # both framings: the chunked one counts (RFC 9112), and "{}" is no chunk: the body never ends
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
     408, "did not arrive within 2 s"),
    # headers past h11's 16 KiB that have not ended yet
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000, 400, "not a valid HTTP request"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 a TLS hello\r\n\r\n", 400, "not a valid HTTP request"),
])
def test_content_length_lies_and_unparsable_requests_are_error_objects(server, logs, raw, status, needle):
    with _connect(server) as s:
        s.sendall(raw)
        error = _error(*_answer(s), status)
    assert needle in error["message"]


def test_a_body_longer_than_its_content_length_is_answered_then_the_rest_refused(server, logs):
    body = json.dumps(GOOD).encode()
    with _connect(server) as s:
        s.sendall(_head(len(body)) + body + b"this is no request\r\n\r\n")
        first, rest = _answers(s, 2)
        assert first[0].status_code == 200 and json.loads(first[1])["usage"]["completion_tokens"] == 2
        assert "not a valid HTTP request" in _error(*rest, 400)["message"]


def test_headers_that_never_finish_are_closed_whatever_trickles_in(server, logs):
    """The deadline runs from the connection, not from the last byte: a byte at a time does not
    hold a connection open."""
    with _connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(0.2)
        closed = False
        for _ in range(int(WAIT_S / 0.2)):
            try:
                s.sendall(b"X")
                closed = s.recv(1) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
    assert closed, "the connection was never closed"


@contextlib.contextmanager
def _header_deadline(server, seconds: float):
    cls = server.service._uvicorn.config.http_protocol_class
    before, cls.header_timeout = cls.header_timeout, seconds
    try:
        yield
    finally:
        cls.header_timeout = before


def test_past_max_connections_a_request_is_503_and_past_twice_the_connection_closed(server, logs):
    connections = server.service._uvicorn.server_state.connections
    with _header_deadline(server, WAIT_S), contextlib.ExitStack() as held:
        idle = [held.enter_context(_connect(server)) for _ in range(8)]
        wait_for(lambda: len(connections) == 8, "8 connections open")
        over = held.enter_context(_connect(server))
        wait_for(lambda: len(connections) == 9, "the 9th connection open")
        over.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        error = _error(*_answer(over), 503)
        assert error["type"] == "unavailable_error" and "8 connections open" in error["message"]
        assert error["headers"]["retry-after"] == "1" and error["headers"]["connection"] == "close"
        more = [held.enter_context(_connect(server)) for _ in range(8)]
        wait_for(lambda: len(connections) >= 16, "16 connections open")
        refused = held.enter_context(_connect(server))
        assert _answer(refused) == (None, b"")
        assert len(idle) + len(more) == 16
    wait_for(lambda: len(connections) == 0, "every held connection closed")


def test_past_max_requests_a_request_is_503_before_its_body_is_read(server, logs):
    guard = server.service._uvicorn.config.app
    before, guard.max_requests = guard.max_requests, 2
    server.gate.close()
    body = {**GOOD, "stream": True, "max_tokens": 3}
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as a, httpx.Client(base_url=server.url,
                                                                                 timeout=WAIT_S) as b:
            streams = [c.stream("POST", "/v1/completions", json=body) for c in (a, b)]
            threads = [threading.Thread(target=lambda st=st: st.__enter__()) for st in streams]
            for t in threads:
                t.start()
            wait_for(lambda: guard.active == 2, "two requests inside the server")
            r = server.http.post("/v1/completions", json=GOOD)
            assert r.status_code == 503 and "handling 2 requests at once" in r.json()["error"]["message"]
            assert r.headers["connection"] == "close"
            server.gate.open()
            for t, st in zip(threads, streams):
                t.join(WAIT_S)
                st.__exit__(None, None, None)
    finally:
        guard.max_requests = before
        server.gate.open()
