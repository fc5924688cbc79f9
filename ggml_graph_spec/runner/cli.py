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
from pathlib import Path
from typing import Sequence

import numpy as np

from gguf_arch.errors import EXIT_INTERRUPTED, run_cli, signals
from gguf_arch.io.console import ArgumentParser
from gguf_arch.io.jsonfile import read_text

from ..backends.streaming.executor import StreamingExecutor
from ..engine.model import Model
from ..engine.options import DEFAULT_CTX, LoadOptions
from ..generation.events import StopRules, Timings
from ..generation.generate import generate
from ..generation.media import generate_media, media_prompt
from ..generation.perplexity import chunk_count, perplexity
from ..generation.sampling import Sampler
from ..text.chat_template import chat_template
from ..text.tokenizer import BPETokenizer
from .agent_args import (add_grammar_arguments, add_reasoning_arguments, check_agent_options, reasoning_given,
                         reply_constraint)
from .args import (add_context_arguments, add_model_argument, add_model_arguments, add_placement_arguments,
                   load_options)
from .chat import Conversation, add_chat_arguments, stream
from .flag_table import CLI
from .flags import add_llama_flags, llama_notes
from .interrupt import sigint_stops
from .media import MediaInput, add_media_arguments, check_media
from .sampling_args import add_sampling_arguments, sampling_params
from .session import PromptExit, run_interactive
from .summary import summary
from .validation import RANDOM_SEED, UsageError, check_options



# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-cli", description=__doc__.split("\n\n")[0])
    add_model_argument(p)
    _add_prompt_arguments(p)
    p.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_CTX,
                   help=f"context size; the perplexity chunk length with --perplexity (default {DEFAULT_CTX}, 0: the model's)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    add_sampling_arguments(p)
    add_chat_arguments(p)
    add_reasoning_arguments(p)
    add_grammar_arguments(p)
    add_model_arguments(p)
    add_context_arguments(p)
    add_placement_arguments(p)
    add_media_arguments(p)
    p.add_argument("--perplexity", action="store_true", help="compute the perplexity of -f FILE (llama-perplexity's method)")
    p.add_argument("--chunks", type=int, default=-1, help="with --perplexity: at most this many chunks (-1: all)")
    add_llama_flags(p, CLI)
    return p


def _add_prompt_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text (special tokens such as [BOS] are parsed)")
    src.add_argument("-f", "--file", type=Path, help="read the prompt (or the perplexity text) from a file")
    p.add_argument("-e", "--escape", action="store_true", default=True,
                   help="turn \\n, \\r, \\t, \\', \\\", \\\\ and \\xNN in -p and -r into the characters they "
                        "name, as llama.cpp does (the default; -f FILE is read as it is)")
    p.add_argument("--no-escape", dest="escape", action="store_false", help="take -p and -r as they are written")
    p.add_argument("--display-prompt", dest="no_display_prompt", action="store_false", default=False,
                   help="echo the prompt before the generated text (the default)")
    p.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt")


def process_escapes(text: str) -> str:
    """llama.cpp's escapes (common's string_process_escapes): \\n \\r \\t \\' \\" \\\\ and \\xNN (a
    byte); a backslash before anything else stays as it is."""
    raw, out, i = text.encode("utf-8", "surrogateescape"), bytearray(), 0
    named = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}
    while i < len(raw):
        if raw[i] != ord("\\") or i + 1 == len(raw):
            out.append(raw[i])
            i += 1
            continue
        nxt = raw[i + 1]
        digits = raw[i + 2:i + 4]
        if nxt in named:
            out += named[nxt]
            i += 2
        elif nxt == ord("x") and len(digits) == 2 and all(chr(d) in "0123456789abcdefABCDEF" for d in digits):
            out.append(int(digits, 16))
            i += 4
        else:
            out += raw[i:i + 2]
            i += 2
    return out.decode("utf-8", "replace")


def run_mode(a: argparse.Namespace) -> str:
    """complete, chat (-cnv), interactive (-i -no-cnv: no template) or perplexity. As in llama-cli,
    -i and no prompt at all mean a conversation; unlike it, a prompt alone means a completion."""
    chat_only = [o for o, v in (("-sys", a.system_prompt if a.system_prompt_file is None else None),
                                ("-sysf", a.system_prompt_file), ("--chat-template", a.chat_template),
                                ("--chat-template-file", a.chat_template_file),
                                ("--chat-template-kwargs", a.chat_template_kwargs), ("-st", a.single_turn or None))
                 if v is not None]
    chat_only += reasoning_given(a)
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
# loading
# ---------------------------------------------------------------------------------------------

def load(path: Path, options: LoadOptions) -> Model:
    """The model, loaded and warmed up."""
    model = Model.load(path, options)
    # Warm-up, as llama-cli does: the first graph of a process pays one-time costs (thread pool,
    # allocator, first touch of the mapped weights) that belong in the load time, not the prompt's.
    try:
        tok = model.tokenizer
        model.eval([tok.bos_id if tok.bos_id is not None else 0])
        model.reset()
    except BaseException:
        model.close()
        raise
    return model


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def _log(lines: Sequence[str], prefix: str = "") -> None:
    for line in lines:
        print(prefix + line, file=sys.stderr)


def _run_perplexity(args: argparse.Namespace, model: Model, tokenizer: BPETokenizer, text: str,
                    timings: Timings, _media: None) -> bool:
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
    return Sampler(sampling_params(args, model.n_ctx, suppress, seed=args.seed))


def _stop_rules(args: argparse.Namespace, tokenizer: BPETokenizer) -> StopRules:
    eog = frozenset() if args.ignore_eos or tokenizer.eos_id is None else frozenset({tokenizer.eos_id})
    return StopRules(eog, args.n_predict, tuple(args.reverse_prompt))


def _run_completion(args: argparse.Namespace, model: Model, tokenizer: BPETokenizer, text: str,
                    timings: Timings, media: MediaInput | None) -> bool:
    prompt = None if media is None else media_prompt(model, media.encoder, text, media.items)
    if not args.no_display_prompt:  # with media: the media blocks the model reads
        sys.stdout.write(text if prompt is None else prompt.text)
    sampler, stop = _sampler(args, model, tokenizer), _stop_rules(args, tokenizer)
    constraint = reply_constraint(tokenizer, "text", args.reply_options)  # -j/--grammar: the whole text
    with sigint_stops() as interrupt:
        flag = lambda: interrupt.requested  # noqa: E731
        generation = (generate(model, tokenizer.encode(text), sampler, stop, timings=timings, stop_requested=flag,
                               constraint=constraint)
                      if prompt is None else
                      generate_media(model, media.encoder, prompt, (), sampler, stop, timings=timings,
                                     stop_requested=flag, constraint=constraint))
        reply = stream(generation, sys.stdout)
    print()
    return reply.reason == "interrupted"


def _run_conversation(args: argparse.Namespace, model: Model, tokenizer: BPETokenizer, text: str | None,
                      timings: Timings, media: MediaInput | None) -> bool:
    template, template_line = None, ""
    if args.mode == "chat":  # the options were checked before loading (chat.check_chat_options)
        template, template_line = chat_template(model.weights.metadata, tokenizer, args.template_file,
                                                args.template_kwargs, model.weights.path)
    elif text is not None and not args.no_display_prompt:
        sys.stdout.write(text)
    conversation = Conversation(model, tokenizer, _sampler(args, model, tokenizer), _stop_rules(args, tokenizer),
                                template, encoder=media and media.encoder, pending=list(media.items) if media else [],
                                options=args.reply_options, color=sys.stdout.isatty(), special=args.special)
    run_interactive(conversation, text, args.system_prompt, template_line, timings, _log, args.single_turn)
    return False


def _draw_seed(requested: int) -> int:
    # As llama.cpp: -1 (or LLAMA_DEFAULT_SEED) asks for a random 32-bit seed, printed so that the run
    # can be repeated with -s.
    return secrets.randbits(32) if requested in (-1, RANDOM_SEED) else requested


_RUNNERS = {"complete": _run_completion, "chat": _run_conversation, "interactive": _run_conversation,
            "perplexity": _run_perplexity}


def run(args: argparse.Namespace) -> int | None:
    _log(llama_notes(args) + check_options(args))
    if args.escape:  # llama.cpp's default: the escapes of -p and -r are the characters they name
        args.prompt = None if args.prompt is None else process_escapes(args.prompt)
        args.reverse_prompt = [process_escapes(r) for r in args.reverse_prompt]
    options = load_options(args, progress=sys.stderr.isatty())  # one load path: LoadOptions, Model.load
    args.mode = run_mode(args)
    check_agent_options(args)  # a bad schema or grammar costs no load
    text = _read_text(args.file) if args.file is not None else args.prompt
    media = check_media(args, text)
    timings = Timings()
    t = time.perf_counter()
    model = load(args.model, options)
    tokenizer = model.tokenizer
    # A stop signal that ends the process inside a ggml call prints the timings too (signals.py).
    signals.at_stop(lambda: [f"kimi_k3_perf: {line}" for line in timings.lines()])
    try:
        if media is not None:  # the same path as the model's: F32 everywhere with --exact-experts
            media.open(exact=args.exact_experts, threads=args.threads)
        timings.load_s = time.perf_counter() - t
        _log(summary(model) + (media.summary() if media is not None else []))
        if args.mode != "perplexity":
            args.seed = _draw_seed(args.seed)
            _log([f"sampler seed: {args.seed}"])
        stop = None
        try:
            if _RUNNERS[args.mode](args, model, tokenizer, text, timings, media):
                stop = KeyboardInterrupt()
        except KeyboardInterrupt as exc:  # Ctrl-C at a conversation's prompt or in perplexity; SIGTERM
            stop = exc
        signals.at_stop(None)
        _log(timings.lines(), prefix="kimi_k3_perf: ")
        if isinstance(model.executor, StreamingExecutor):  # the expert cache's hits over the whole run
            _log([f"{k}: {v}" for k, v in model.executor.stats()], prefix="kimi_k3_perf: ")
        if isinstance(stop, PromptExit):  # Ctrl-C at a conversation's prompt: its normal end, no error line
            return EXIT_INTERRUPTED
        if stop is not None:  # llama-cli prints the timings, then exits 130 (143 for SIGTERM)
            raise stop
    finally:
        if media is not None:
            media.close()
        model.close()


def main(argv: Sequence[str] | None = None) -> int:
    # Parsing runs inside run_cli: the --override-kv converter raises UsageError for a bad value.
    return run_cli(lambda: run(build_parser().parse_args(argv)), runtime_errors=(OSError, MemoryError, RuntimeError))
