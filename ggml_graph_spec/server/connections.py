"""Connections that hold the server up without asking it anything, bounded (uvicorn's h11
protocol, with two limits uvicorn does not have):

* **slow headers**: a request's line and headers must have arrived within `header_timeout`
  seconds of the connection (or of the previous response on it); else the connection is closed,
  nothing sent (a client that sends a byte a minute holds no connection for long). Uvicorn's
  own keep-alive timeout (5 s) closes a connection that sends nothing after a response; once
  the headers are in, the body has --timeout (http.py) and each write too;
* **many connections**: past `max_connections` open at once, a new connection's request is
  answered 503 (OpenAI's error object, Retry-After, `Connection: close`) without reaching the
  application; past twice as many it is closed at once, so that file descriptors stay for the
  connections being served.

uvicorn's `limit_concurrency` would answer a plain-text 503; this answers in the API's shape, and
so is a request h11 cannot parse (a Content-Length that is no number, a body longer than it said
whose rest is no request, a line past 16 KiB of headers): a 400 error object, then the close.
"""
from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import bad_request, unavailable
from .http import error_response


def busy_app(max_connections: int):
    """The application an over-limit connection's request gets."""
    async def app(scope, receive, send) -> None:
        error = unavailable(f"the server has {max_connections} connections open, its most; retry later",
                            retry_after=1)
        error.headers["Connection"] = "close"
        await error_response(error, scope.get("path", ""))(scope, receive, send)
    return app


class BoundedH11(H11Protocol):
    """H11Protocol with a deadline on headers and a bound on connections (subclassed per server
    by `protocol`, which sets the two limits)."""

    header_timeout = 10.0
    max_connections = 256
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > 2 * self.max_connections:
            transport.close()
            return
        if len(self.connections) > self.max_connections:
            self.app = busy_app(self.max_connections)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in: --timeout bounds the rest
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # the next request's headers are awaited from now
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 cannot parse, as OpenAI's error object."""
        body = json.dumps(bad_request(f"not a valid HTTP request ({msg.rstrip('.')})").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response had begun on this connection: only the close is left
            pass
        self.transport.close()

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol(header_timeout: float, max_connections: int) -> type[BoundedH11]:
    """uvicorn's `http` protocol class with these limits."""
    return type("BoundedH11", (BoundedH11,), {"header_timeout": header_timeout, "max_connections": max_connections})
