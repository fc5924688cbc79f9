"""Token generation for the runner: prefill, then sample, stream and evaluate one token at a time,
with llama-cli's stop rules and its timing lines.

One loop serves a plain completion and every turn of a conversation. It never resets the model:
the caller decides what is new (a conversation feeds each turn's new tokens only, the caches keep
the rest). A Ctrl-C during generation (`sigint_stops`) is only noted, and the loop stops between
two tokens, so the caches always hold exactly the tokens evaluated so far.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, TextIO

import numpy as np

from gguf_arch.errors.signals import Graceful, graceful_sigint
from gguf_arch.io.console import UsageError

from ..engine.model import Model
from .sampling import Sampler
from ..text.tokenizer import BPETokenizer


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


# A Ctrl-C during generation is only noted (`Interrupt.requested`), a second one ends the process:
# gguf_arch/errors/signals.py, where every stop signal is handled.
Interrupt = Graceful
sigint_stops = graceful_sigint


@dataclass(frozen=True)
class StopRules:
    eog: frozenset[int]  # tokens that end generation (the EOS); not printed
    n_predict: int = -1  # < 0: no limit
    reverse_prompts: tuple[str, ...] = ()  # stop once the output shows one of them


@dataclass
class Reply:
    tokens: list[int] = field(default_factory=list)  # every sampled token, the last one included
    text: str = ""  # what was printed
    reason: str = ""  # eog, n_predict, context, reverse prompt, interrupted
    pending: int | None = None  # the last sampled token: not yet evaluated, so not in the caches


def prefill(model: Model, tokens: Sequence[int], timings: Timings) -> np.ndarray:
    """Evaluate the new tokens; the logits of the last one."""
    if not tokens:
        raise UsageError("the prompt tokenizes to no tokens")
    if model.n_past + len(tokens) >= model.n_ctx:
        raise UsageError(f"the prompt is {model.n_past + len(tokens)} tokens, the context -c {model.n_ctx}: "
                         "raise -c or shorten the prompt")
    t = time.perf_counter()
    logits = model.eval(list(tokens))[-1]
    timings.prompt_s += time.perf_counter() - t
    timings.prompt_tokens += len(tokens)
    return logits


def _stop_reason(reply: Reply, piece: str, stop: StopRules, model: Model) -> str:
    window = reply.text[-(max(map(len, stop.reverse_prompts), default=0) + len(piece)):]
    if any(p in window for p in stop.reverse_prompts):
        return "reverse prompt"
    if len(reply.tokens) == stop.n_predict:
        return "n_predict"
    return "context" if model.n_past >= model.n_ctx else ""


def generate(model: Model, tokenizer: BPETokenizer, tokens: Sequence[int], sampler: Sampler, stop: StopRules, *,
             out: TextIO, timings: Timings, show: Callable[[int], bool] = lambda _t: True,
             interrupt: Interrupt | None = None) -> Reply:
    """Evaluate `tokens` (appended to what the caches hold), then sample and stream until a stop
    rule, a full context or an interrupt. `show` decides which tokens are printed."""
    logits = prefill(model, tokens, timings)
    sampler.accept(tokens)
    decoder = tokenizer.stream_decoder()
    reply = Reply()
    while not (interrupt is not None and interrupt.requested):
        t = time.perf_counter()
        token = sampler(logits)
        timings.sample_s += time.perf_counter() - t
        timings.samples += 1
        sampler.accept([token])
        reply.tokens.append(token)
        reply.pending = token
        if token in stop.eog:
            reply.reason = "eog"
            break
        piece = decoder.push(token) if show(token) else ""
        reply.text += piece
        out.write(piece)
        out.flush()
        reply.reason = _stop_reason(reply, piece, stop, model)
        if reply.reason:
            break
        t = time.perf_counter()
        logits = model.eval([token])[-1]
        timings.eval_s += time.perf_counter() - t
        timings.eval_runs += 1
        reply.pending = None
    else:
        reply.reason = "interrupted"
    tail = decoder.flush()
    reply.text += tail
    out.write(tail)
    out.flush()
    return reply
