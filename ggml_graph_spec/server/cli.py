"""kimi-k3-server: serve a kimi-k3 GGUF to applications, as llama-server does: OpenAI's API, many
clients at once, a prompt cache, a chat page.

    kimi-k3-server -m k31pro.gguf -np 4 -c 16384

Flags are llama-server's where it has one (-c is the context of all slots together, split evenly
over the -np slots). The summary, the request log and errors go to stderr.

Exit codes: 0 stopped by SIGINT / SIGTERM / SIGHUP (also while loading); 1 the address cannot be
had, or the engine failed; 2 bad arguments or a bad GGUF.
"""
from __future__ import annotations

from gguf_arch.errors.signals import install

install(stop_code=0)  # first: a stop signal from here on (the imports below, the load) ends it with 0

import argparse
import contextlib
import ipaddress
import math
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator, Sequence

from gguf_arch.errors import run_cli
from gguf_arch.io.console import ArgumentParser, UsageError, human_size

from ..engine.model import Model
from ..engine.options import DEFAULT_CTX
from ..generation.media import check_encoder
from ..runner.agent_args import add_grammar_arguments, add_reasoning_arguments, reply_options
from ..runner.args import (add_context_arguments, add_model_argument, add_model_arguments, add_placement_arguments,
                          load_options)
from ..runner.chat import add_template_arguments, check_chat_options
from ..runner.flag_table import SERVER
from ..runner.flags import add_llama_flags, llama_notes
from ..runner.cli import load
from ..runner.media import add_mmproj_argument, check_mmproj
from ..runner.sampling_args import RANDOM_SEED, add_sampling_arguments, check_sampling, sampling_params
from ..runner.summary import summary
from ..runner.validation import cap_threads
from ..text.chat_template import chat_template
from ..vision.encode import VisionEncoder
from .agent import AgentDefaults
from .app import HttpSettings, Server, model_props
from .protocol import ALL_TOKENS, RequestDefaults
from .engine import Engine
from .media import Vision
from .service import Service, bind
from .slot_files import SlotFiles

DEFAULT_PORT = 8080
DEFAULT_QUEUE = 16
DEFAULT_MAX_BODY = 20 * 2**20  # room for an image as a data URI
DEFAULT_TIMEOUT_S = 600.0  # llama-server's
DEFAULT_CHECKPOINTS = 1
_SIZE = re.compile(r"(\d+)\s*([KMG]?)(?:i?B)?", re.IGNORECASE)


def _size(text: str) -> int:
    m = _SIZE.fullmatch(text.strip())
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 512K, 20M or 1G, got {text!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-server", description=__doc__.split("\n\n")[0])
    add_model_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: requests decoded together (default 1)")
    p.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_CTX,
                   help=f"context of all slots together, split evenly over them (default {DEFAULT_CTX}; 0: the "
                        "model's per slot)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all this process may use)")
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY) on every endpoint "
                                                   "but /health, /v1/models and the chat page")
    p.add_argument("-a", "--alias", default=None, help="the model's name in the API (default: the GGUF's file name)")
    p.add_argument("-to", "--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to read a request body, and for a client to take each write (default "
                        f"{DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--queue", type=int, default=DEFAULT_QUEUE,
                   help=f"requests waiting for a slot beyond the busy ones; more are refused with 503 and Retry-After "
                        f"(default {DEFAULT_QUEUE})")
    p.add_argument("--max-body", type=_size, default=DEFAULT_MAX_BODY,
                   help="the largest request body; larger is refused with 413 (default 20M)")
    p.add_argument("--slot-save-path", type=Path, default=None,
                   help="directory of the slot files of POST /slots/{id}?action=save|restore (default: no slot actions)")
    p.add_argument("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", dest="ctx_checkpoints", type=int,
                   default=DEFAULT_CHECKPOINTS,
                   help=f"prompt-cache checkpoints kept per slot: the state at the end of its last prompts "
                        f"(default {DEFAULT_CHECKPOINTS}; 0: none)")
    add_template_arguments(p)
    add_sampling_arguments(p, server=True)  # the defaults of the requests (llama-server's)
    add_reasoning_arguments(p)  # their reasoning defaults
    add_grammar_arguments(p)  # the constraint of a request that asks none
    add_model_arguments(p)
    add_context_arguments(p)  # -b (the most prompt tokens a slot feeds in one step), -ub, -ctk
    add_placement_arguments(p)
    add_mmproj_argument(p)
    add_llama_flags(p, SERVER)
    return p


def check(a: argparse.Namespace) -> list[str]:
    """Raise UsageError for the first bad option; notes to print."""
    if not 0 <= a.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {a.port}")
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        raise UsageError(f"--timeout must be a positive number of seconds, got {a.timeout}")
    for flag, value in (("--queue", a.queue), ("--ctx-checkpoints", a.ctx_checkpoints)):
        if value < 0:
            raise UsageError(f"{flag} must be >= 0, got {value}")
    if a.slot_save_path is not None and a.slot_save_path.exists() and not a.slot_save_path.is_dir():
        raise UsageError(f"--slot-save-path {a.slot_save_path}: not a directory")
    check_sampling(a)
    if a.n_predict == 0:
        raise UsageError("-n/--n-predict must be >= 1 (or -1: until the end-of-generation token), got 0")
    check_chat_options(a)  # a missing, unreadable or failing template file is an error before loading
    a.reply_options = reply_options(a)  # a schema or grammar that cannot be used: an error before loading
    notes = llama_notes(a) + cap_threads(a)
    if not _loopback(a.host) and a.api_key is None:
        notes.append(f"warning: listening on {a.host} without --api-key: anyone who can reach this address can "
                     "use the model")
    return notes


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def server_lines(model: Model, a: argparse.Namespace) -> list[str]:
    """The slots, the context of each, and the memory their caches and checkpoints take."""
    c = model.cache
    per_slot = c.bytes_per_sequence() + model.n_ctx * sum(c.bytes_per_token().values())
    rows = [("slots", f"{model.n_seq} (-np), {model.n_ctx} tokens of context each"),
            ("slot caches", f"{human_size(per_slot)} per slot at a full context, {human_size(per_slot * model.n_seq)} "
                            "in all"),
            ("prompt cache", f"each slot's history, and up to {a.ctx_checkpoints} checkpoint(s) per slot in host "
                             f"memory: at most {human_size(per_slot * a.ctx_checkpoints * model.n_seq)} in all")]
    return [f"print_info: {k:<16} = {v}" for k, v in rows]


class _StopSignals:
    """While serving: SIGINT, SIGTERM and SIGHUP ask for an orderly stop (an event the main
    thread waits on) instead of raising where the main thread happens to be."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None

    def _handler(self, signum: int, _frame: object) -> None:
        self.signum = signum
        self.event.set()


@contextlib.contextmanager
def stop_signals() -> Iterator[_StopSignals]:
    stop = _StopSignals()
    names = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, stop._handler) for s in names}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def start_engine(model: Model, service: Service, a: argparse.Namespace) -> Engine:
    """The chat template, the engine thread and the slot files for a loaded model, attached to the
    service: from here on it serves the model."""
    # The template file and kwargs were checked before loading (check_chat_options); the GGUF's
    # own template is compiled here, in the same bounded sandbox.
    template, where = chat_template(model.weights.metadata, model.tokenizer, a.template_file, a.template_kwargs,
                                    model.weights.path)
    files = None
    if a.slot_save_path is not None:
        a.slot_save_path.mkdir(parents=True, exist_ok=True)
        files = SlotFiles(a.slot_save_path)
    if a.mmproj is not None:  # image_url parts (server/media.py), on the model's path
        encoder = VisionEncoder.open(a.mmproj, exact=a.exact_experts, threads=a.threads)
        service.server.vision = Vision(encoder)
        check_encoder(model, encoder)
    engine = Engine(model, queue_size=a.queue, checkpoints=a.ctx_checkpoints, prefill_chunk=a.batch_size,
                    slot_files=files, log=service.server.log)
    service.attach(engine, template, model_props(model, a.api_key is not None, where, template.text,
                                                 vision=a.mmproj is not None))
    service.server.log(where)
    return engine


def _serve(model: Model, service: Service, a: argparse.Namespace) -> int:
    with stop_signals() as stop:
        engine = start_engine(model, service, a)
        _log(f"server is listening on {service.address} (chat page at {service.address}/)")
        while not stop.event.wait(1.0) and service.alive():
            pass
        _log(f"stopping ({signal.Signals(stop.signum).name})" if stop.signum else "stopping: "
             f"{engine.failure or service.http_failure or 'the HTTP server ended'}")
        clean = service.stop()
    return 0 if stop.signum is not None and clean else 1


def request_defaults(a: argparse.Namespace) -> RequestDefaults:
    """What a request that omits a sampling field, max_tokens or ignore_eos gets: the flags' values
    (llama-server's way). --repeat-last-n -1 is the whole context: no slot holds more than ALL_TOKENS."""
    seed = None if a.seed in (-1, RANDOM_SEED) else a.seed
    return RequestDefaults(sampling_params(a, ALL_TOKENS, seed=seed), a.n_predict, a.ignore_eos)


def http_settings(a: argparse.Namespace) -> HttpSettings:
    o = a.reply_options
    agent = AgentDefaults(o.reasoning_format, o.reasoning_budget, o.budget_message, o.thinking, o.effort, o.response)
    # Every slot's stream and queued request twice over, and room for /health, /metrics, /slots.
    max_requests = 2 * (a.parallel + a.queue) + 32
    return HttpSettings(a.alias or a.model.name, a.api_key, a.max_body, a.timeout, a.slot_save_path,
                        request_defaults(a), agent, max_requests=max_requests)


def run(a: argparse.Namespace) -> int:
    for note in check(a):
        _log(note)
    options = load_options(a, n_seq=a.parallel, progress=sys.stderr.isatty())
    if a.mmproj is not None:
        check_mmproj(a.mmproj, a.model)  # another model's mmproj too
    try:
        sock = bind(a.host, a.port)
    except OSError as exc:
        raise OSError(f"cannot listen on {a.host}:{a.port} ({exc.strerror or exc})") from None
    service = Service(Server(http_settings(a), _log), sock)
    _log(f"server is up on {service.address}; loading {a.model} (/health answers 503 until it is loaded)")
    try:
        model = load(a.model, options)
    except KeyboardInterrupt as exc:  # Interrupted too: its signal (a plain KeyboardInterrupt is a Ctrl-C)
        service.stop()
        _log(f"stopping ({signal.Signals(getattr(exc, 'signum', signal.SIGINT)).name}) while loading the model")
        return 0
    except BaseException:
        service.stop()
        raise
    try:
        for line in summary(model) + server_lines(model, a):
            _log(line)
        return _serve(model, service, a)
    finally:
        service.stop()  # a no-op after an orderly stop; after a failure, ends the threads first
        if service.server.vision is not None:
            service.server.vision.close()
        model.close()


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), runtime_errors=(OSError, MemoryError, RuntimeError))


if __name__ == "__main__":
    sys.exit(main())
