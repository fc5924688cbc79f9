"""A job's reply relayed to its client, whole or as server-sent events, in the shapes of the API it
came in by: OpenAI's chat and text completions, OpenAI's Responses, Anthropic's Messages. Each API
is an adapter with the same four calls (token, end, error, whole); the relay itself is one.

A client that goes away cancels its job (its slot is freed at the next step); a failure mid-stream
is the API's error event, last.
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi.sse import format_sse_event
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import http
from .engine import Engine
from .errors import ApiError
from .jobs import Job, Result
from .replies import Piece, Reply, Shapes


def sse(obj: dict, event: str | None = None) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False), event=event)


class ChatApi:
    """OpenAI's /v1/chat/completions and /v1/completions."""

    def __init__(self, shapes: Shapes) -> None:
        self.shapes, self._first = shapes, True

    def start(self) -> list[bytes]:
        return []

    def token(self, reply: Reply, text: str, entries: list[dict], pieces: list[Piece]) -> list[bytes]:
        out = []
        for piece in pieces:
            out.append(sse(self.shapes.chunk(reply, "", [], first=self._first, piece=piece)))
            self._first = False
        if text or entries or self._first:
            out.append(sse(self.shapes.chunk(reply, text, entries, first=self._first)))
            self._first = False
        return out

    def end(self, reply: Reply, result: Result, tail: str) -> list[bytes]:
        out = [sse(self.shapes.last_chunk(reply, result, tail))]
        if reply.request.include_usage:
            out.append(sse(self.shapes.usage_chunk(result)))
        return out + [format_sse_event(data_str="[DONE]")]

    def error(self, error: ApiError) -> list[bytes]:
        return [sse(error.body())]

    def whole(self, reply: Reply, result: Result) -> dict:
        return self.shapes.whole(reply, result)


async def relay(engine: Engine, request: Request, job: Job, api, reply: Reply) -> Response:
    """The whole reply once it has ended: every token's pieces go through the adapter in order."""
    gone = asyncio.ensure_future(http.until_disconnect(request))
    try:
        while True:
            item = asyncio.ensure_future(job.queue.get())
            await asyncio.wait({item, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not item.done():  # the client went away: free its slot at the next step
                item.cancel()
                engine.cancel(job)
                return Response(status_code=499)
            kind, value = item.result()
            if kind == "token":
                _collect(api, reply, *reply.push(*value))
            elif kind == "end":
                tail = reply.flush()
                if tail:
                    _collect(api, reply, tail, [], [])
                return JSONResponse(api.whole(reply, value))
            else:
                raise value
    finally:
        gone.cancel()


def _collect(api, reply: Reply, text: str, entries: list[dict], pieces: list[Piece]) -> None:
    collect = getattr(api, "collect", None)
    if collect is not None:  # an API whose whole reply is built from the pieces (Responses, Messages)
        collect(reply, text, pieces)


async def stream(engine: Engine, job: Job, api, reply: Reply) -> AsyncIterator[bytes]:
    """The reply as server-sent events, in the adapter's shapes."""
    ended = False
    try:
        for chunk in api.start():
            yield chunk
        while not ended:
            kind, value = await job.queue.get()
            if kind == "token":
                for chunk in api.token(reply, *reply.push(*value)):
                    yield chunk
                continue
            ended = True
            chunks = api.error(value) if kind == "error" else api.end(reply, value, reply.flush())
            for chunk in chunks:
                yield chunk
    finally:
        if not ended:
            engine.cancel(job)
