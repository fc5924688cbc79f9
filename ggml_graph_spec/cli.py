"""kimi-k3-cli: run a kimi-k3 GGUF through the Python-built ggml graph, as llama-cli does.

Flags are named as llama-cli and llama-perplexity name them, so a command line moves between
the two runtimes. Text generation streams to stdout; the model summary, the timings and
errors go to stderr, as llama.cpp logs them.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

import ggml
import numpy as np

from gguf_arch.arch.config import K3Config
from gguf_arch.arch.keys import config_from_metadata
from gguf_arch.errors import run_cli
from gguf_arch.io.jsonfile import read_text

from .loader import load_gguf
from .graph import DSA_PATHS
from .model import Model
from .perplexity import chunk_count, perplexity
from .sampling import DEFAULT_MIN_P, DEFAULT_TEMP, DEFAULT_TOP_K, DEFAULT_TOP_P, Sampler, SamplingParams
from .tokenizer import BPETokenizer
from .validation import UsageError, apply_overrides, check_dsa, check_options, tokenizer_settings

DEFAULT_CTX = 4096  # llama-cli's -c default


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block before its message; the tools promise one line.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message} (see --help)")


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
    p = _Parser(prog="kimi-k3-cli", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", type=Path, required=True,
                   help="kimi-k3 GGUF (a split GGUF: its first file, *-00001-of-0000N.gguf)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text (special tokens such as [BOS] are parsed)")
    src.add_argument("-f", "--file", type=Path, help="read the prompt (or the perplexity text) from a file")
    p.add_argument("-n", "--n-predict", type=int, default=-1, help="tokens to generate (-1: until EOS or a full context)")
    p.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_CTX,
                   help=f"context size; the perplexity chunk length with --perplexity (default {DEFAULT_CTX}, 0: the model's)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--temp", type=float, default=DEFAULT_TEMP, help=f"temperature, 0 = greedy (default {DEFAULT_TEMP})")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help=f"top-k sampling, 0 = off (default {DEFAULT_TOP_K})")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help=f"top-p sampling, 1.0 = off (default {DEFAULT_TOP_P})")
    p.add_argument("--min-p", type=float, default=DEFAULT_MIN_P, help=f"min-p sampling, 0.0 = off (default {DEFAULT_MIN_P})")
    p.add_argument("--seed", type=int, default=-1, help="RNG seed (-1: random)")
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
    p.add_argument("--repack", action="store_true",
                   help="copy the routed experts into ggml's repacked MXFP4 layout, as llama.cpp does by default: "
                        "faster MoE matmuls, anonymous memory the size of the experts (fast path only)")
    p.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt")
    p.add_argument("--perplexity", action="store_true", help="compute the perplexity of -f FILE (llama-perplexity's method)")
    p.add_argument("--chunks", type=int, default=-1, help="with --perplexity: at most this many chunks (-1: all)")
    return p


def _read_text(path: Path) -> str:
    # The one FIFO-safe reader: a FIFO, socket or device given as -f is refused, never waited on.
    return read_text(path, UsageError, "no such file")


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------

@dataclass
class Timings:
    load_s: float = 0.0
    prompt_s: float = 0.0
    prompt_tokens: int = 0
    eval_s: float = 0.0
    eval_runs: int = 0
    sample_s: float = 0.0
    samples: int = 0

    def lines(self) -> list[str]:
        total = self.load_s + self.prompt_s + self.eval_s + self.sample_s
        sampling = [f"{'sampling time':>17} = {self.sample_s * 1e3:10.2f} ms / {self.samples:5d} runs   "
                    f"{_rate(self.sample_s, self.samples)}"] if self.samples else []
        return [
            f"{'load time':>17} = {self.load_s * 1e3:10.2f} ms",
            *sampling,
            f"{'prompt eval time':>17} = {self.prompt_s * 1e3:10.2f} ms / {self.prompt_tokens:5d} tokens "
            f"{_rate(self.prompt_s, self.prompt_tokens)}",
            f"{'eval time':>17} = {self.eval_s * 1e3:10.2f} ms / {self.eval_runs:5d} runs   "
            f"{_rate(self.eval_s, self.eval_runs)}",
            f"{'total time':>17} = {total * 1e3:10.2f} ms / {self.prompt_tokens + self.eval_runs:5d} tokens",
        ]


def _rate(seconds: float, n: int) -> str:
    if n == 0 or seconds <= 0:
        return "(    n/a ms per token,      n/a tokens per second)"
    return f"({seconds * 1e3 / n:8.2f} ms per token, {n / seconds:8.2f} tokens per second)"


def generate(model: Model, tokenizer: BPETokenizer, prompt_ids: Sequence[int], sampler: Sampler, *, n_predict: int,
             n_ctx: int, out: TextIO, timings: Timings) -> list[int]:
    """Prefill the prompt, then sample and stream tokens until EOS, n_predict or a full context."""
    if not prompt_ids:
        raise UsageError("kimi-k3-cli: the prompt tokenizes to no tokens")
    if len(prompt_ids) >= n_ctx:
        raise UsageError(f"kimi-k3-cli: the prompt is {len(prompt_ids)} tokens, the context -c {n_ctx}: "
                         "raise -c or shorten the prompt")
    t = time.perf_counter()
    logits = model.eval(list(prompt_ids))[-1]
    timings.prompt_s, timings.prompt_tokens = time.perf_counter() - t, len(prompt_ids)
    decoder = tokenizer.stream_decoder()
    generated: list[int] = []
    n_past = len(prompt_ids)
    while n_predict < 0 or len(generated) < n_predict:
        t = time.perf_counter()
        token = sampler(logits)
        timings.sample_s += time.perf_counter() - t
        timings.samples += 1
        if token == tokenizer.eos_id:
            break
        generated.append(token)
        out.write(decoder.push(token))
        out.flush()
        if n_past >= n_ctx or len(generated) == n_predict:
            break
        t = time.perf_counter()
        logits = model.eval([token])[-1]
        timings.eval_s += time.perf_counter() - t
        timings.eval_runs += 1
        n_past += 1
    out.write(decoder.flush())
    out.flush()
    return generated


# ---------------------------------------------------------------------------------------------
# loading: overrides, context size, summary
# ---------------------------------------------------------------------------------------------

def _context_size(requested: int, cfg: K3Config) -> int:
    if requested == 0:
        return cfg.context_length
    if requested > cfg.context_length:
        raise UsageError(f"kimi-k3-cli: -c {requested} exceeds the model's context length {cfg.context_length}")
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
    weights = load_gguf(args.model, repack=args.repack, adjust=adjust)
    try:
        tokenizer = BPETokenizer.from_gguf(weights.reader)
        for attr, value in tokenizer_settings(overrides).items():
            setattr(tokenizer, attr, value)
        model = Model(weights, n_ctx=_context_size(args.ctx_size, weights.cfg), exact=args.exact_experts,
                      dsa=args.dsa != "off", top_k=None, n_threads=args.threads, dsa_path=args.dsa_path)
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
                     + (f"{len(w.repacked)} expert tensors repacked ({w.repacked_bytes / 2**20:.1f} MiB)"
                        if w.repacked else "weights mapped from the file, none repacked")),
        ("BOS / EOS", f"{tokenizer.bos_id} / {tokenizer.eos_id} (add BOS: {str(tokenizer.add_bos).lower()})"),
    ]
    rows += [("override", f"{k} = {v!r}") for k, v in overrides.items()]
    return [f"print_info: {k:<16} = {v}" for k, v in rows]


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def _log(lines: Sequence[str], prefix: str = "") -> None:
    for line in lines:
        print(prefix + line, file=sys.stderr)


def _run_perplexity(args: argparse.Namespace, model: Model, tokenizer: BPETokenizer, text: str,
                    timings: Timings) -> None:
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


def _run_generation(args: argparse.Namespace, model: Model, tokenizer: BPETokenizer, text: str,
                    timings: Timings) -> None:
    ids = tokenizer.encode(text)
    sampler = Sampler(SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                     seed=None if args.seed < 0 else args.seed))
    if not args.no_display_prompt:
        sys.stdout.write(text)
    generate(model, tokenizer, ids, sampler, n_predict=args.n_predict, n_ctx=model.n_ctx, out=sys.stdout,
             timings=timings)
    print()


def run(args: argparse.Namespace) -> None:
    _log(check_options(args))
    text = _read_text(args.file) if args.file is not None else args.prompt
    timings = Timings()
    t = time.perf_counter()
    model, tokenizer = load(args)
    timings.load_s = time.perf_counter() - t
    try:
        _log(summary(model, tokenizer, dict(args.override_kv)))
        if args.perplexity:
            _run_perplexity(args, model, tokenizer, text, timings)
        else:
            _run_generation(args, model, tokenizer, text, timings)
        _log(timings.lines(), prefix="kimi_k3_perf: ")
    finally:
        model.close()


def main(argv: Sequence[str] | None = None) -> int:
    # Parsing runs inside run_cli: the --override-kv converter raises UsageError for a bad value.
    return run_cli(lambda: run(build_parser().parse_args(argv)), runtime_errors=(OSError, MemoryError, RuntimeError))
