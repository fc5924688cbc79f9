"""kimi-k3-cli: run a kimi-k3 GGUF through the Python-built ggml graph, as llama-cli does.

Flags are named as llama-cli and llama-perplexity name them, so a command line moves between
the two runtimes. Text generation streams to stdout; the model summary, the timings and
errors go to stderr, as llama.cpp logs them.
"""
from __future__ import annotations

from gguf_arch.errors.signals import install

install()  # first: a stop signal during the imports below is the documented line and code

import argparse
import secrets
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import ggml
import numpy as np

from gguf_arch.arch.config import K3Config
from gguf_arch.arch.keys import config_from_metadata
from gguf_arch.errors import run_cli, signals
from gguf_arch.io.console import ArgumentParser, human_size
from gguf_arch.io.jsonfile import read_text

from .chat import Conversation, add_chat_arguments, chat_template, run_interactive
from ..generation.generate import StopRules, Timings, generate, sigint_stops
from ..graph.build import DSA_PATHS
from ..weights.loader import load_gguf
from ..backends.rpc.wire import DEFAULT_TIMEOUT_S, RpcTargets, add_rpc_arguments
from ..backends.streaming.budget import add_budget_argument
from ..backends.streaming.executor import StreamingExecutor
from ..engine.model import Model
from ..generation.perplexity import chunk_count, perplexity
from ..weights.repack import add_repack_arguments, resolve_repack
from ..generation.sampling import (DEFAULT_MIN_P, DEFAULT_REPEAT_LAST_N, DEFAULT_REPEAT_PENALTY, DEFAULT_TEMP, DEFAULT_TOP_K,
                       DEFAULT_TOP_P, Sampler, SamplingParams)
from ..text.tokenizer import BPETokenizer
from .validation import RANDOM_SEED, UsageError, apply_overrides, check_dsa, check_options, tokenizer_settings

DEFAULT_CTX = 4096  # llama-cli's -c default


# ---------------------------------------------------------------------------------------------
# --override-kv
# ---------------------------------------------------------------------------------------------

def _parse_bool(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError("bool is 'true' or 'false'")
    return text == "true"


_OVERRIDE_TYPES = {"int": int, "float": float, "bool": _parse_bool, "str": str}


def parse_override_kv(spec: str) -> tuple[str, Any]:
    """`KEY=TYPE:VALUE` (llama.cpp's syntax, TYPE int|float|bool|str) -> (KEY, typed value)."""
    key, eq, rest = spec.partition("=")
    kind, colon, text = rest.partition(":")
    if not (key and eq and colon) or kind not in _OVERRIDE_TYPES:
        raise UsageError(f"--override-kv {spec!r}: expected KEY=TYPE:VALUE with TYPE one of "
                         f"{', '.join(_OVERRIDE_TYPES)}")
    try:
        return key, _OVERRIDE_TYPES[kind](text)
    except ValueError as exc:
        raise UsageError(f"--override-kv {spec!r}: {text!r} is not a {kind} ({exc})") from None


def _override(spec: str) -> tuple[str, Any]:
    try:
        return parse_override_kv(spec)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--override-kv ")) from None


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-cli", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", type=Path, required=True,
                   help="kimi-k3 GGUF (a split GGUF: its first file, *-00001-of-0000N.gguf)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text (special tokens such as [BOS] are parsed)")
    src.add_argument("-f", "--file", type=Path, help="read the prompt (or the perplexity text) from a file")
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="tokens to generate (in a conversation: per reply; -1: until EOS or a full context)")
    p.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_CTX,
                   help=f"context size; the perplexity chunk length with --perplexity (default {DEFAULT_CTX}, 0: the model's)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--temp", type=float, default=DEFAULT_TEMP, help=f"temperature, <= 0 = greedy (default {DEFAULT_TEMP})")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help=f"top-k sampling, 0 = off (default {DEFAULT_TOP_K})")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help=f"top-p sampling, 1.0 = off (default {DEFAULT_TOP_P})")
    p.add_argument("--min-p", type=float, default=DEFAULT_MIN_P, help=f"min-p sampling, 0.0 = off (default {DEFAULT_MIN_P})")
    p.add_argument("--repeat-penalty", type=float, default=DEFAULT_REPEAT_PENALTY,
                   help=f"penalise repeating the last --repeat-last-n tokens, 1.0 = off (default {DEFAULT_REPEAT_PENALTY})")
    p.add_argument("--repeat-last-n", type=int, default=DEFAULT_REPEAT_LAST_N,
                   help=f"tokens the repeat penalty looks back on, 0 = off, -1 = the context size "
                        f"(default {DEFAULT_REPEAT_LAST_N})")
    p.add_argument("-s", "--seed", type=int, default=-1,
                   help=f"RNG seed (-1 or {RANDOM_SEED}: a random one, printed as 'sampler seed: N')")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never sample the end-of-generation token (EOS); go on until -n, a reverse prompt or a full context")
    add_chat_arguments(p)
    p.add_argument("--override-kv", type=_override, action="append", default=[], metavar="KEY=TYPE:VALUE",
                   help="override a GGUF metadata value, e.g. kimi-k3.attention.indexer.top_k=int:64 (repeatable)")
    p.add_argument("--dsa", choices=("on", "off"), default=None,
                   help="run the DSA indexer of a K3.1-Pro GGUF (default: on; off: dense MLA attention)")
    p.add_argument("--dsa-path", choices=DSA_PATHS, default=None,
                   help="DSA attention: gather = over only the top_k selected cache rows per query, masked = over "
                        "the whole cache with the selection as a mask (same logits to rounding; default: gather, "
                        "the faster one)")
    p.add_argument("--exact-experts", action="store_true",
                   help="exact path: F32 activations in every matmul, F32 caches, no flash attention")
    add_repack_arguments(p)
    add_rpc_arguments(p)
    add_budget_argument(p)
    p.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt")
    p.add_argument("--perplexity", action="store_true", help="compute the perplexity of -f FILE (llama-perplexity's method)")
    p.add_argument("--chunks", type=int, default=-1, help="with --perplexity: at most this many chunks (-1: all)")
    return p


def run_mode(a: argparse.Namespace) -> str:
    """complete, chat (-cnv), interactive (-i -no-cnv: no template) or perplexity. As in llama-cli,
    -i and no prompt at all mean a conversation; unlike it, a prompt alone means a completion."""
    chat_only = [o for o, v in (("-sys", a.system_prompt), ("--chat-template-file", a.chat_template_file),
                                ("--chat-template-kwargs", a.chat_template_kwargs)) if v is not None]
    if a.perplexity:
        if a.conversation or a.interactive:
            raise UsageError("--perplexity scores a file; it does not run a conversation (-cnv/-i)")
        return "perplexity"
    if a.conversation is False and chat_only:
        raise UsageError(f"{chat_only[0]} applies to a conversation, not with -no-cnv")
    if a.conversation or chat_only or (a.conversation is None and (a.interactive or (a.prompt is None
                                                                                     and a.file is None))):
        return "chat"
    if a.interactive:
        return "interactive"
    if a.prompt is None and a.file is None:
        raise UsageError("give a prompt with -p TEXT or -f FILE (or -cnv for a conversation)")
    return "complete"


def _read_text(path: Path) -> str:
    # The one FIFO-safe reader: a FIFO, socket or device given as -f is refused, never waited on.
    return read_text(path, UsageError, "no such file")


# ---------------------------------------------------------------------------------------------
# loading: overrides, context size, summary
# ---------------------------------------------------------------------------------------------

def _context_size(requested: int, cfg: K3Config) -> int:
    if requested == 0:
        return cfg.context_length
    if requested > cfg.context_length:
        raise UsageError(f"-c {requested} exceeds the model's context length {cfg.context_length}")
    return requested


def load(args: argparse.Namespace) -> tuple[Model, BPETokenizer]:
    """The model and tokenizer as the arguments ask for them."""
    overrides = dict(args.override_kv)

    def adjust(meta: dict[str, Any], cfg: K3Config) -> tuple[dict[str, Any], K3Config]:
        # Before any ggml object: the overrides and the context size against the model's.
        meta, cfg = apply_overrides(meta, cfg, overrides, str(args.model), config_from_metadata)
        _context_size(args.ctx_size, cfg)
        check_dsa(args.dsa, args.dsa_path, cfg, str(args.model))
        return meta, cfg
    repack = resolve_repack(args.repack, exact=args.exact_experts, rpc=args.rpc is not None,
                            mem_budget=args.mem_budget is not None)
    weights = load_gguf(args.model, repack=repack, adjust=adjust)
    try:
        tokenizer = BPETokenizer.from_gguf(weights.reader)
        for attr, value in tokenizer_settings(overrides).items():
            setattr(tokenizer, attr, value)
        model = Model(weights, n_ctx=_context_size(args.ctx_size, weights.cfg), exact=args.exact_experts,
                      dsa=args.dsa != "off", top_k=None, n_threads=args.threads, dsa_path=args.dsa_path,
                      rpc=RpcTargets(args.rpc, args.rpc_timeout or DEFAULT_TIMEOUT_S) if args.rpc else (),
                      tensor_split=args.tensor_split, progress=sys.stderr.isatty(),
                      mem_budget=args.mem_budget)
    except BaseException:
        weights.close()
        raise
    # Warm-up, as llama-cli does: the first graph of a process pays one-time costs (thread pool,
    # allocator, first touch of the mapped weights) that belong in the load time, not the prompt's.
    model.eval([tokenizer.bos_id if tokenizer.bos_id is not None else 0])
    model.reset()
    return model, tokenizer


def summary(model: Model, tokenizer: BPETokenizer, overrides: dict[str, Any]) -> list[str]:
    """llama.cpp-style `print_info` lines about the loaded model (after the overrides)."""
    cfg, w = model.cfg, model.weights
    types = Counter(ggml.ggml_type_name(t.contents.type).decode() for t in w.tensors.values())
    dsa = "none (plain kimi-k3)"
    if cfg.indexer is not None:
        state = f"on, top_k {model.top_k}, {model.dsa_path}" if model.top_k is not None else "off: dense MLA"
        dsa = f"{list(cfg.indexer.layers)} ({state})"
    rows = [
        ("file", f"{w.path}"),
        ("arch", w.metadata.get("general.architecture", "?")),
        ("name", w.metadata.get("general.name", "?")),
        ("n_layer", f"{cfg.num_layers} ({len(cfg.kda.layers)} KDA, {len(cfg.mla_layers)} MLA)"),
        ("DSA layers", dsa),
        ("n_embd", cfg.hidden_size),
        ("n_vocab", cfg.vocab_size),
        ("n_expert", f"{cfg.num_experts} ({cfg.num_experts_used} used, {cfg.num_shared_experts} shared, "
                     f"{cfg.first_k_dense_replace} dense layer(s) first)"),
        ("n_ctx", f"{model.n_ctx} (train {cfg.context_length})"),
        ("tensor types", ", ".join(f"{n} {k}" for k, n in sorted(types.items()))),
        ("path", "exact (F32 activations, F32 caches)" if model.exact else "fast (as llama.cpp: quantized "
                 "activations for quantized weights, F16 latent cache)"),
        ("ggml CPU", f"llamafile sgemm {'on' if ggml.ggml_cpu_has_llamafile() else 'off (slower prompt batches)'}; "
                     + (f"{len(w.repacked)} expert tensors repacked ({human_size(w.repacked_bytes)})"
                        if w.repacked else "weights mapped from the file, none repacked")
                     + (f" ({w.repack_why})" if w.repack_why else "")),
        ("BOS / EOS", f"{tokenizer.bos_id} / {tokenizer.eos_id} (add BOS: {str(tokenizer.add_bos).lower()})"),
    ]
    if model.devices is not None:
        rows += model.devices.summary(model.cache, model.executor)
    if isinstance(model.executor, StreamingExecutor):
        rows += model.executor.summary()
    rows += [("override", f"{k} = {v!r}") for k, v in overrides.items()] + [("note", n) for n in w.notes]
    return [f"print_info: {k:<16} = {v}" for k, v in rows]


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def _log(lines: Sequence[str], prefix: str = "") -> None:
    for line in lines:
        print(prefix + line, file=sys.stderr)


def _run_perplexity(args: argparse.Namespace, model: Model, tokenizer: BPETokenizer, text: str,
                    timings: Timings) -> bool:
    tokens = tokenizer.encode(text)
    n_ctx = model.n_ctx

    def evaluate(chunk: list[int]) -> np.ndarray:
        model.reset()
        t = time.perf_counter()
        logits = model.eval(chunk)
        timings.prompt_s += time.perf_counter() - t
        timings.prompt_tokens += len(chunk)
        return logits

    def progress(i: int, ppl: float) -> None:
        print(f"[{i + 1}]{ppl:.4f},", end="", flush=True)

    n_chunks = chunk_count(len(tokens), n_ctx, args.chunks)
    _log([f"perplexity: calculating perplexity over {n_chunks} chunks, n_ctx={n_ctx} ({len(tokens)} tokens; "
          "the second half of each chunk is scored)"])
    r = perplexity(tokens, n_ctx, evaluate, bos=tokenizer.bos_id if tokenizer.add_bos else None,
                   n_chunks=args.chunks, on_chunk=progress)
    print()
    print(r.final_line())
    return False


def _sampler(args: argparse.Namespace, model: Model, tokenizer: BPETokenizer) -> Sampler:
    suppress = frozenset({tokenizer.eos_id}) if args.ignore_eos and tokenizer.eos_id is not None else frozenset()
    last_n = model.n_ctx if args.repeat_last_n == -1 else args.repeat_last_n
    return Sampler(SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                  seed=args.seed, repeat_penalty=args.repeat_penalty, repeat_last_n=last_n,
                                  suppress=suppress))


def _stop_rules(args: argparse.Namespace, tokenizer: BPETokenizer) -> StopRules:
    eog = frozenset() if args.ignore_eos or tokenizer.eos_id is None else frozenset({tokenizer.eos_id})
    return StopRules(eog, args.n_predict, tuple(args.reverse_prompt))


def _run_completion(args: argparse.Namespace, model: Model, tokenizer: BPETokenizer, text: str,
                    timings: Timings) -> bool:
    if not args.no_display_prompt:
        sys.stdout.write(text)
    with sigint_stops() as interrupt:
        reply = generate(model, tokenizer, tokenizer.encode(text), _sampler(args, model, tokenizer),
                         _stop_rules(args, tokenizer), out=sys.stdout, timings=timings, interrupt=interrupt)
    print()
    return reply.reason == "interrupted"


def _run_conversation(args: argparse.Namespace, model: Model, tokenizer: BPETokenizer, text: str | None,
                      timings: Timings) -> bool:
    template, template_line = None, ""
    if args.mode == "chat":  # the options were checked before loading (chat.check_chat_options)
        template, template_line = chat_template(model.weights.metadata, tokenizer, args.template_file,
                                                args.template_kwargs, model.weights.path)
    elif text is not None and not args.no_display_prompt:
        sys.stdout.write(text)
    conversation = Conversation(model, tokenizer, _sampler(args, model, tokenizer), _stop_rules(args, tokenizer),
                                template)
    run_interactive(conversation, text, args.system_prompt, template_line, timings, _log)
    return False


def _draw_seed(requested: int) -> int:
    # As llama.cpp: -1 (or LLAMA_DEFAULT_SEED) asks for a random 32-bit seed, printed so that the run
    # can be repeated with -s.
    return secrets.randbits(32) if requested in (-1, RANDOM_SEED) else requested


_RUNNERS = {"complete": _run_completion, "chat": _run_conversation, "interactive": _run_conversation,
            "perplexity": _run_perplexity}


def run(args: argparse.Namespace) -> None:
    _log(check_options(args))
    args.mode = run_mode(args)
    text = _read_text(args.file) if args.file is not None else args.prompt
    timings = Timings()
    t = time.perf_counter()
    model, tokenizer = load(args)
    timings.load_s = time.perf_counter() - t
    # A stop signal that ends the process inside a ggml call prints the timings too (signals.py).
    signals.at_stop(lambda: [f"kimi_k3_perf: {line}" for line in timings.lines()])
    try:
        _log(summary(model, tokenizer, dict(args.override_kv)))
        if args.mode != "perplexity":
            args.seed = _draw_seed(args.seed)
            _log([f"sampler seed: {args.seed}"])
        stop = None
        try:
            if _RUNNERS[args.mode](args, model, tokenizer, text, timings):
                stop = KeyboardInterrupt()
        except KeyboardInterrupt as exc:  # Ctrl-C at a conversation's prompt or in perplexity; SIGTERM
            stop = exc
        signals.at_stop(None)
        _log(timings.lines(), prefix="kimi_k3_perf: ")
        if isinstance(model.executor, StreamingExecutor):  # the expert cache's hits over the whole run
            _log([f"{k}: {v}" for k, v in model.executor.stats()], prefix="kimi_k3_perf: ")
        if stop is not None:  # llama-cli prints the timings, then exits 130 (143 for SIGTERM)
            raise stop
    finally:
        model.close()


def main(argv: Sequence[str] | None = None) -> int:
    # Parsing runs inside run_cli: the --override-kv converter raises UsageError for a bad value.
    return run_cli(lambda: run(build_parser().parse_args(argv)), runtime_errors=(OSError, MemoryError, RuntimeError))
