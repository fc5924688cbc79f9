"""The outermost layer of the ASGI application: what no request may do to the server.

* **No traceback, ever.** An exception out of any handler or stream (a fault of the server's own:
  a request's error is an ApiError long before) is one line in the server's log, `error: METHOD
  PATH: Type: message`, and a 500 error object to the client when nothing was sent yet, else the
  end of the reply. Starlette re-raises every exception after its 500 handler ran so that the
  server can log it, and uvicorn then prints the whole traceback: it stops here instead. A client
  that went away (a closed connection, a cancelled task) is not a fault: nothing is logged.
* **Bounded work in flight.** At most `max_requests` requests are inside the application at once
  (each holds at most --max-body bytes of body); one more is answered 503 with Retry-After and
  `Connection: close` before a byte of its body is read.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from starlette.requests import ClientDisconnect

from .errors import SERVER, ApiError, unavailable
from .http import error_response

# A client that went away: what a write to it or a read from it raises.
GONE = (ClientDisconnect, ConnectionError, asyncio.CancelledError)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _describe(exc: BaseException) -> str:
    return "; ".join(f"{type(e).__name__}: {e}" for e in _leaves(exc))[:500].replace("\n", " ")


class Guard:
    def __init__(self, app, log: Callable[[str], None], max_requests: int) -> None:
        self.app, self.log, self.max_requests = app, log, max_requests
        self.active = 0  # requests inside the application (the event loop's thread only)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.active >= self.max_requests:
            busy = unavailable(f"the server is handling {self.active} requests at once, its most; retry later",
                               retry_after=1)
            busy.headers["Connection"] = "close"
            await error_response(busy, scope["path"])(scope, receive, send)
            return
        self.active += 1
        sent = _Sent(send)
        try:
            await self.app(scope, receive, sent)
        except BaseException as exc:  # noqa: BLE001 - the last place an exception can be said in one line
            await self._contain(exc, scope, receive, sent)
        finally:
            self.active -= 1

    async def _contain(self, exc: BaseException, scope, receive, sent: "_Sent") -> None:
        if all(isinstance(e, GONE) for e in _leaves(exc)):
            return
        self.log(f"error: {scope['method']} {scope['path']}: {_describe(exc)}")
        try:
            if not sent.started:
                error = ApiError(500, SERVER, _describe(exc)[:200])
                await error_response(error, scope["path"])(scope, receive, sent)
            elif not sent.complete:  # a reply under way: end it where it is (a stream's client sees it stop)
                await sent({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # noqa: BLE001 - the connection is gone too: nothing left to tell
            pass


class _Sent:
    """`send`, remembering how far the response got."""

    def __init__(self, send) -> None:
        self.send, self.started, self.complete = send, False, False

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self.send(message)
