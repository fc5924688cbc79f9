"""The HTTP edges of the server, on Starlette's ASGI interfaces: the API key, the body's size and
read timeout, the write timeout, and every failure as OpenAI's error object."""
from __future__ import annotations

import asyncio
import hmac
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from . import bodies
from .bodies import ClientGone
from .errors import AUTHENTICATION, INVALID_REQUEST, NOT_FOUND, SERVER, TOO_LARGE, ApiError, anthropic_error

# llama-server's public endpoints: no key needed (the chat page asks for one itself).
PUBLIC = ("/", "/health", "/v1/health", "/models", "/v1/models", "/favicon.ico")
PUBLIC_PREFIXES = ("/static/",)


ANTHROPIC_PATHS = ("/v1/messages",)  # answered in Anthropic's error shape


def error_response(error: ApiError, path: str = "") -> JSONResponse:
    body = anthropic_error(error) if path.startswith(ANTHROPIC_PATHS) else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own 404 / 405, in OpenAI's shape."""
    kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
    return error_response(ApiError(exc.status_code, kind, str(exc.detail)))


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A fault of the server's own: one error object to the client (Starlette then re-raises it,
    and guard.py says it in one log line)."""
    return error_response(ApiError(500, SERVER, f"{type(exc).__name__}: {exc}"), request.url.path)


class ApiKey:
    """--api-key: every endpoint but the public ones wants `Authorization: Bearer KEY` (or
    `X-Api-Key: KEY`), compared in constant time; 401 otherwise."""

    def __init__(self, app, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.key is not None and not _public(scope["path"]) and \
                not self._allowed(scope):
            await error_response(ApiError(401, AUTHENTICATION, "Invalid API Key"))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self.key.encode())


def _public(path: str) -> bool:
    return path in PUBLIC or path.startswith(PUBLIC_PREFIXES)


class WriteTimeout:
    """--timeout on writes: a client that does not read what is sent to it for that long is
    dropped (its generation, if any, is cancelled like any other disconnect)."""

    def __init__(self, app, seconds: float, log) -> None:
        self.app, self.seconds, self.log = app, seconds, log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def timed_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.seconds)
            except TimeoutError:
                raise _Stalled from None
        try:
            await self.app(scope, receive, timed_send)
        except BaseException as exc:  # noqa: BLE001 - the stall may come wrapped in a task group's group
            if not _is_stall(exc):
                raise
            self.log(f"{scope['path']}: the client read nothing for {self.seconds:g} s (--timeout): dropped")


class _Stalled(Exception):
    pass


def _is_stall(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_stall(e) for e in exc.exceptions)
    return isinstance(exc, _Stalled)


async def read_json(request: Request, limit: int, timeout: float) -> Any:
    """The request body as JSON (bodies.py's rules): at most `limit` bytes (413 beyond: the rest is
    read and dropped, so that the client hears the answer), read within `timeout` seconds (408);
    a client that goes away meanwhile: ClientGone, nothing queued."""
    try:
        async with asyncio.timeout(timeout):
            body = await _read_body(request, limit)
    except TimeoutError:
        raise ApiError(408, INVALID_REQUEST, f"the request body did not arrive within {timeout:g} s (--timeout)") \
            from None
    except ClientDisconnect:
        raise ClientGone() from None
    return bodies.parse(body)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    parts, size, over = [], 0, declared.isdigit() and int(declared) > limit
    async for chunk in request.stream():
        size += len(chunk)
        over = over or size > limit
        if not over:
            parts.append(chunk)
    if over:
        raise ApiError(413, TOO_LARGE, f"the request body is {size} bytes; this server takes at most {limit} "
                                       "(--max-body)")
    return b"".join(parts)


async def until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
