"""The ASGI application: llama-server's endpoints with OpenAI's shapes, on FastAPI.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health
    POST /v1/responses (OpenAI's Responses)   POST /v1/messages, /v1/messages/count_tokens (Anthropic's)
    POST /apply-template   POST /v1/chat/completions/input_tokens
    GET /metrics   GET /slots   POST /slots/{id}?action=save|restore|erase   GET /props   GET /openapi.json
    POST /tokenize   POST /detokenize   GET / (the chat page)   GET /favicon.ico

Handlers never touch the model: they check and tokenize a request (in a worker thread), hand a
job to the engine thread (engine.py) and relay what it posts back, whole or as server-sent events.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from ..text.chat_template import ChatTemplate, unmark
from . import http, openapi, protocol, streams
from .agent import AgentDefaults
from .engine import Engine
from .guard import Guard
from .errors import EXCEED_CONTEXT, LOADING, NOT_SUPPORTED, ApiError, bad_request, unavailable
from .jobs import Job
from .media import Vision
from .metrics import registry_for, render
from .replies import Reply, Shapes
from . import messages_api, responses_api
from .messages_api import MessagesApi
from .responses_api import ResponsesApi
from .streams import ChatApi
from .slot_files import ACTIONS

STATIC = Path(__file__).with_name("static")
_SLOT_ID = re.compile(r"[0-9]{1,9}")


@dataclass(frozen=True)
class HttpSettings:
    alias: str  # the model's name in /v1/models and in replies
    api_key: str | None
    max_body: int  # bytes
    timeout: float  # seconds: reading a body, and each write
    slot_save_path: Path | None
    defaults: protocol.RequestDefaults = protocol.RequestDefaults()  # of a request's omitted fields: the flags
    agent: AgentDefaults = AgentDefaults()  # reasoning defaults of requests (--reasoning-*)
    max_requests: int = 64  # requests inside the application at once (guard.py); more: 503
    max_connections: int = 256  # open connections (connections.py); more: 503, then closed at once
    header_timeout: float = 10.0  # seconds for a request's line and headers (connections.py)


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


def model_props(model, api_key_required: bool, template_where: str, template_text: str = "",
                vision: bool = False) -> dict:
    """/props (and the `meta` of /v1/models): the slots, the context of each, the model, the chat
    template's text (llama-server's `chat_template`) and where it came from, and what a message may
    hold besides text (llama-server's `modalities`: images with --mmproj)."""
    stat = model.weights.path.stat()
    meta = {"n_vocab": model.cfg.vocab_size, "n_ctx_train": model.cfg.context_length, "n_ctx": model.n_ctx,
            "size": stat.st_size, "created": int(stat.st_mtime)}
    return {"total_slots": model.n_seq, "model_path": str(model.weights.path), "chat_template": template_text,
            "chat_template_source": template_where,
            "api_key_required": api_key_required, "meta": meta, "default_generation_settings": {"n_ctx": model.n_ctx},
            "modalities": {"vision": vision, "audio": False}}


def build_app(server: Server) -> Any:
    app = FastAPI(title="kimi-k3-server", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, http.api_error)
    app.add_exception_handler(HTTPException, http.http_error)
    app.add_exception_handler(Exception, http.internal_error)
    _info_routes(app, server)
    _generation_routes(app, server)
    _agent_routes(app, server)
    _slot_routes(app, server)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    guarded = http.ApiKey(app, server.settings.api_key)
    return Guard(http.WriteTimeout(guarded, server.settings.timeout, server.log), server.log,
                 server.settings.max_requests)


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

    @app.get("/openapi.json")
    async def schema() -> Response:
        """Every endpoint's request body, as the server checks it (openapi.py)."""
        return JSONResponse(openapi.document())

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


def _agent_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses(request: Request) -> Response:
        raw = await server.body(request)
        body = responses_api.chat_body(raw)
        return await _generate(server, request, True, body, lambda _job: ResponsesApi(server.settings.alias, raw))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        raw = await server.body(request)
        body = messages_api.chat_body(raw)
        return await _generate(server, request, True, body, lambda _job: MessagesApi(server.settings.alias))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        body = messages_api.chat_body({k: v for k, v in (await server.body(request)).items() if k != "max_tokens"}
                                      | {"max_tokens": 1})
        return JSONResponse({"input_tokens": len((await _rendered(server, body)).ids)})

    @app.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        """llama-server's: the prompt a chat request renders to, as text."""
        return JSONResponse({"prompt": unmark((await _rendered(server, await server.body(request))).text)})

    @app.post("/v1/chat/completions/input_tokens")
    async def input_tokens(request: Request) -> Response:
        return JSONResponse({"input_tokens": len((await _rendered(server, await server.body(request))).ids)})


async def _rendered(server: Server, body: Any) -> protocol.ChatPrompt:
    engine = server.need_engine()
    body = protocol.check_object(body)
    protocol.gen_request(body, [], True, engine.model.tokenizer.eos_id, server.settings.defaults,
                         engine.model.tokenizer.vocab_size)
    return await run_in_threadpool(protocol.chat_prompt, body, server.template, engine.model.tokenizer,
                                   server.vision, server.settings.agent)


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
        if not _SLOT_ID.fullmatch(slot_id) or int(slot_id) >= len(engine.slots):  # not isdigit: "²" is a digit
            raise bad_request(f"slot id must be 0..{len(engine.slots) - 1}, got {slot_id!r}")
        filename = None
        if action != "erase":
            filename = protocol.check_object(await server.body(request)).get("filename")
        future = engine.slot_action(int(slot_id), action, filename)
        return JSONResponse(await asyncio.wrap_future(future))


# ---- generation ----------------------------------------------------------------------------------

async def _generate(server: Server, request: Request, chat: bool, body: Any = None,
                    api_of: Callable[[Any], Any] | None = None) -> Response:
    """A chat or text completion (`body`: a chat request another API was turned into; `api_of`:
    the adapter of that API's shapes, given the job)."""
    engine = server.need_engine()
    if body is None:
        body = protocol.check_object(await server.body(request))
    gen = await _job_request(server, engine, body, chat)
    job = Job(gen, asyncio.get_running_loop())
    engine.submit(job)
    reply = Reply(gen, engine.model.tokenizer)
    api = api_of(job) if api_of is not None else ChatApi(Shapes(server.settings.alias, chat, job.id))
    if gen.stream:
        return EventSourceResponse(streams.stream(engine, job, api, reply))
    return await streams.relay(engine, request, job, api, reply)


async def _job_request(server: Server, engine: Engine, body: Any, chat: bool) -> protocol.GenRequest:
    """What the engine runs for `body`: checked, rendered, tokenized, its grammar compiled and its
    images encoded (in worker threads, beside the engine's steps)."""
    tok = engine.model.tokenizer
    # every field checked before any tokenizing
    params = protocol.gen_request(body, [], chat, tok.eos_id, server.settings.defaults, tok.vocab_size)
    reply, plan = None, None
    if chat:
        cp = await run_in_threadpool(protocol.chat_prompt, body, server.template, tok, server.vision,
                                     server.settings.agent)
        prompt, images, reply = cp.ids, cp.items, cp.reply
    else:
        prompt, images = await run_in_threadpool(protocol.completion_prompt, body, tok), []
        plan = await run_in_threadpool(protocol.completion_plan, body, tok, server.settings.agent)
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
    return gen
