"""The ASGI application: llama-server's endpoints with OpenAI's shapes, on FastAPI.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health
    GET /metrics   GET /slots   POST /slots/{id}?action=save|restore|erase   GET /props
    POST /tokenize   POST /detokenize   GET / (the chat page)   GET /favicon.ico

Handlers never touch the model: they check and tokenize a request (in a worker thread), hand a
job to the engine thread (engine.py) and relay what it posts back, whole or as server-sent events.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from ..text.chat_template import ChatTemplate
from . import http, protocol
from .agent import AgentDefaults
from .engine import Engine
from .errors import EXCEED_CONTEXT, LOADING, NOT_SUPPORTED, ApiError, bad_request, unavailable
from .jobs import Job
from .media import Vision
from .metrics import registry_for, render
from .replies import Reply, Shapes
from .slot_files import ACTIONS

STATIC = Path(__file__).with_name("static")


@dataclass(frozen=True)
class HttpSettings:
    alias: str  # the model's name in /v1/models and in replies
    api_key: str | None
    max_body: int  # bytes
    timeout: float  # seconds: reading a body, and each write
    slot_save_path: Path | None
    agent: AgentDefaults = AgentDefaults()  # reasoning defaults of requests (--reasoning-*)


class Server:
    """What the handlers share: the settings, and once loaded the engine, tokenizer and template."""

    def __init__(self, settings: HttpSettings, log, vision: Vision | None = None) -> None:
        self.settings, self.log, self.vision = settings, log, vision
        self.engine: Engine | None = None
        self.template: ChatTemplate | None = None
        self.props: dict = {}
        self.registry = None

    def ready(self, engine: Engine, template: ChatTemplate, props: dict) -> None:
        self.template, self.props, self.registry = template, props, registry_for(engine)
        self.engine = engine  # last: a handler that sees the engine sees everything else

    def need_engine(self) -> Engine:
        if self.engine is None:
            raise unavailable(LOADING)
        return self.engine

    async def body(self, request: Request) -> Any:
        return await http.read_json(request, self.settings.max_body, self.settings.timeout)


def model_props(model, api_key_required: bool, template_where: str, vision: bool = False) -> dict:
    """/props (and the `meta` of /v1/models): the slots, the context of each, the model, and what
    a message may hold besides text (llama-server's `modalities`: images with --mmproj)."""
    stat = model.weights.path.stat()
    meta = {"n_vocab": model.cfg.vocab_size, "n_ctx_train": model.cfg.context_length, "n_ctx": model.n_ctx,
            "size": stat.st_size, "created": int(stat.st_mtime)}
    return {"total_slots": model.n_seq, "model_path": str(model.weights.path), "chat_template": template_where,
            "api_key_required": api_key_required, "meta": meta, "default_generation_settings": {"n_ctx": model.n_ctx},
            "modalities": {"vision": vision, "audio": False}}


def build_app(server: Server) -> Any:
    app = FastAPI(title="kimi-k3-server", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, http.api_error)
    app.add_exception_handler(HTTPException, http.http_error)
    app.add_exception_handler(Exception, http.internal_error(server.log))
    _info_routes(app, server)
    _generation_routes(app, server)
    _slot_routes(app, server)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    guarded = http.ApiKey(app, server.settings.api_key)
    return http.WriteTimeout(guarded, server.settings.timeout, server.log)


def _info_routes(app: FastAPI, server: Server) -> None:
    @app.get("/")
    async def page() -> Response:
        return FileResponse(STATIC / "index.html")

    @app.get("/favicon.ico")
    async def favicon() -> Response:  # what browsers ask for when a page names no icon
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> Response:
        server.need_engine()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> Response:
        meta = server.props.get("meta", {})
        return JSONResponse({"object": "list", "data": [{"id": server.settings.alias, "object": "model",
                                                         "created": meta.get("created", 0),
                                                         "owned_by": "kimi-k3-gguf", "meta": meta}]})

    @app.get("/props")
    async def props() -> Response:
        server.need_engine()
        return JSONResponse(server.props)

    @app.get("/metrics")
    async def metrics() -> Response:
        server.need_engine()
        return Response(render(server.registry), media_type="text/plain; version=0.0.4; charset=utf-8")


def _generation_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(server, request, chat=True)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request) -> Response:
        return await _generate(server, request, chat=False)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        engine = server.need_engine()
        body = protocol.check_object(await server.body(request))
        content = protocol.get_field(body, "content", (str,), "a string", "")
        add = protocol.get_field(body, "add_special", (bool,), "true or false", False)
        pieces = protocol.get_field(body, "with_pieces", (bool,), "true or false", False)
        tok = engine.model.tokenizer
        ids = await run_in_threadpool(tok.encode, content, add_bos=add and tok.bos_id is not None)
        if pieces:
            return JSONResponse({"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]})
        return JSONResponse({"tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        engine = server.need_engine()
        body = protocol.check_object(await server.body(request))
        tok = engine.model.tokenizer
        ids = protocol.token_ids(body.get("tokens", []), "tokens", tok.vocab_size)
        return JSONResponse({"content": await run_in_threadpool(tok.decode, ids)})


def _slot_routes(app: FastAPI, server: Server) -> None:
    @app.get("/slots")
    async def slots() -> Response:
        return JSONResponse(server.need_engine().slot_view())

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: str, request: Request) -> Response:
        engine = server.need_engine()
        if server.settings.slot_save_path is None:
            raise ApiError(501, NOT_SUPPORTED, "this server does not support slot actions: start it with "
                                               "--slot-save-path DIR")
        action = request.query_params.get("action")
        if action not in ACTIONS:
            raise bad_request(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
        if not slot_id.isdigit() or int(slot_id) >= len(engine.slots):
            raise bad_request(f"slot id must be 0..{len(engine.slots) - 1}, got {slot_id!r}")
        filename = None
        if action != "erase":
            filename = protocol.check_object(await server.body(request)).get("filename")
        future = engine.slot_action(int(slot_id), action, filename)
        return JSONResponse(await asyncio.wrap_future(future))


# ---- generation ----------------------------------------------------------------------------------

async def _generate(server: Server, request: Request, chat: bool) -> Response:
    engine = server.need_engine()
    body = protocol.check_object(await server.body(request))
    tok = engine.model.tokenizer
    params = protocol.gen_request(body, [], chat, tok.eos_id, tok.vocab_size)  # every field checked before any tokenizing
    reply, plan = None, None
    if chat:
        cp = await run_in_threadpool(protocol.chat_prompt, body, server.template, tok, server.vision,
                                     server.settings.agent)
        prompt, images, reply = cp.ids, cp.items, cp.reply
    else:
        prompt, images = await run_in_threadpool(protocol.completion_prompt, body, tok), []
        plan = await run_in_threadpool(protocol.completion_plan, body, tok)
    media = server.vision.plan(prompt, images) if images else None
    if media is not None:  # the rows' positions count; the rows are no tokens the prompt cache can compare
        prompt = media.merged.token_ids.tolist()
    n_ctx = engine.model.n_ctx
    if len(prompt) >= n_ctx:
        raise ApiError(400, EXCEED_CONTEXT, f"the request exceeds the available context size: the prompt is "
                       f"{len(prompt)} tokens, a slot holds {n_ctx} (-c / -np)", n_prompt_tokens=len(prompt),
                       n_ctx=n_ctx)
    gen = replace(params, prompt=prompt, reply=reply, plan=plan)
    if media is not None:  # encoded only once the prompt is known to fit
        runs = await run_in_threadpool(server.vision.runs, engine.model, media)
        gen = replace(gen, runs=runs, cache_prompt=False)
    job = Job(gen, asyncio.get_running_loop())
    engine.submit(job)
    shapes, reply = Shapes(server.settings.alias, chat, job.id), Reply(gen, tok)
    if gen.stream:
        return EventSourceResponse(_stream(engine, job, shapes, reply))
    return await _whole(engine, request, job, shapes, reply)


async def _whole(engine: Engine, request: Request, job: Job, shapes: Shapes, reply: Reply) -> Response:
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
                reply.push(*value)
            elif kind == "end":
                reply.flush()
                return JSONResponse(shapes.whole(reply, value))
            else:
                raise value
    finally:
        gone.cancel()


def _sse(obj: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False))


async def _stream(engine: Engine, job: Job, shapes: Shapes, reply: Reply) -> AsyncIterator[bytes]:
    """The reply as server-sent events ending in `data: [DONE]`; a failure mid-stream is an
    `error` object as the last event (llama-server's way). A client that goes away cancels the job."""
    ended, first = False, True
    try:
        while not ended:
            kind, value = await job.queue.get()
            if kind == "token":
                text, entries, parts = reply.push(*value)
                for part in parts:
                    yield _sse(shapes.chunk(reply, "", [], first=first, part=part))
                    first = False
                if text or entries or first:
                    yield _sse(shapes.chunk(reply, text, entries, first=first))
                    first = False
                continue
            ended = True
            if kind == "error":
                yield _sse(value.body())
                return
            yield _sse(shapes.last_chunk(reply, value, reply.flush()))
            if reply.request.include_usage:
                yield _sse(shapes.usage_chunk(value))
            yield format_sse_event(data_str="[DONE]")
    finally:
        if not ended:
            engine.cancel(job)
