"""Continuous batching: many generations on one model, one graph per step.

    gen = BatchGenerator(model)
    a = gen.add(seq=0, prompt=ids_a, sampler=Sampler(params_a), stop=StopRules(...))
    b = gen.add(seq=1, prompt=ids_b, sampler=Sampler(params_b), stop=StopRules(...))
    while gen.active:
        for request, event in gen.step():   # one model.decode for every active request
            ...

Each step feeds every active request what it needs next in ONE `Model.decode` call: a new
request's prompt (or its next prefill chunk), a decoding request its last sampled token. A request
may join (`add`) or leave (`cancel`, a stop rule) between any two steps; a new prompt is prefilled
while the others decode. The MoE weights are read once a step for all of them (graph/ubatch.py).

What a request's sequence holds is its business: the caller picks the sequence (the server's slot)
and whether its cached tokens are a prefix of the prompt (`prompt` is then only the rest).

A prompt is token ids, or runs in order (a prompt with images: `MergedPrompt.segments`, or
media.py): token id runs and embedding-row runs (float32 [n, n_embd], an image's rows in place of
token embeddings). A step feeds a request one run at most (the engine takes a sequence's ids or its
rows in one call, not both), or its next `prefill_chunk` positions of it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import numpy as np

from ..engine.model import Model
from .events import Reply, StopRules, Timings, TokenEvent, stop_reason
from .sampling import Sampler, log_softmax, top_logprobs

Run = Union[Sequence[int], np.ndarray]  # token ids, or embedding rows float32 [n, n_embd]
Prompt = Union[Sequence[int], Sequence[np.ndarray]]  # token ids, or runs in order


def is_rows(run: Run) -> bool:
    return isinstance(run, np.ndarray) and run.dtype.kind == "f"


def prompt_runs(prompt: Prompt) -> list[Run]:
    """A prompt as runs: token ids (or one array) are one run; a list of arrays is the runs already
    (empty ones left out)."""
    if isinstance(prompt, np.ndarray):
        return [prompt] if len(prompt) else []
    if len(prompt) and all(isinstance(r, np.ndarray) for r in prompt):
        return [r for r in prompt if len(r)]
    return [list(prompt)] if len(prompt) else []


def prompt_length(prompt: Prompt) -> int:
    """The positions a prompt takes in its sequence (a row takes one, as a token does)."""
    return sum(len(r) for r in prompt_runs(prompt))


def _ids(runs: list[Run]) -> list[int]:
    """The runs' token ids, in order, without the rows (what the sampler's penalties see)."""
    return [int(t) for r in runs if not is_rows(r) for t in r]


@dataclass(eq=False)
class Request:
    """One generation on one sequence."""

    seq: int
    sampler: Sampler
    stop: StopRules
    show: Callable[[int], bool]  # which tokens' text is part of the reply
    constraint: object | None  # chat/constraint.Constraint: masks the logits, told each sampled token
    logprobs: int  # top alternatives per token to report (0: only the sampled token's, -1: none)
    todo: list[Run]  # runs still to feed: the prompt's rest, or the last sampled token
    decoder: object  # the tokenizer's StreamDecoder
    reply: Reply = field(default_factory=Reply)
    prefilling: bool = True
    prompt_tokens: int = 0
    t_start: float = 0.0


class BatchGenerator:
    def __init__(self, model: Model, *, prefill_chunk: int | None = None, timings: Timings | None = None):
        """prefill_chunk: the most prompt tokens a request feeds in one step (None: the model's
        n_batch, -b), so that a long prompt does not stall the other requests' decoding for long."""
        self.model = model
        self.tokenizer = model.tokenizer
        self.prefill_chunk = prefill_chunk or model.n_batch
        self.timings = timings if timings is not None else Timings()
        self._requests: list[Request] = []

    @property
    def active(self) -> list[Request]:
        return list(self._requests)

    def add(self, seq: int, prompt: Prompt, sampler: Sampler, stop: StopRules, *,
            show: Callable[[int], bool] = lambda _t: True, logprobs: int = -1,
            constraint: object | None = None) -> Request:
        """A new request on sequence seq, whose cached tokens come before `prompt` (token ids, or
        runs of ids and rows); `constraint` (chat/constraint.py) limits what it may sample."""
        if any(r.seq == seq for r in self._requests):
            raise ValueError(f"sequence {seq} already has an active request")
        runs = prompt_runs(prompt)
        if not runs:
            raise ValueError("a request needs at least one prompt token")
        sampler.accept(_ids(runs))
        r = Request(seq, sampler, stop, show, constraint, logprobs, runs, self.tokenizer.stream_decoder(),
                    prompt_tokens=sum(map(len, runs)), t_start=time.perf_counter())
        self._requests.append(r)
        return r

    def cancel(self, request: Request, reason: str = "cancelled") -> str:
        """End a request between steps; the text its decoder still held back."""
        if request in self._requests:
            self._requests.remove(request)
            request.reply.reason = request.reply.reason or reason
        tail = request.decoder.flush()
        request.reply.text += tail
        return tail

    def step(self) -> list[tuple[Request, TokenEvent]]:
        """Feed every active request, then sample the next token of each that finished its prompt."""
        return self.sample(self.feed())

    def feed(self) -> dict[int, np.ndarray]:
        """The step's model call: every active request's next input in one decode; seq -> logits
        of its last token. Each request's sampled token is in the caches afterwards."""
        if not self._requests:
            return {}
        feed = {r.seq: self._next_input(r) for r in self._requests}
        t = time.perf_counter()
        logits = self.model.decode(feed)
        self._account(time.perf_counter() - t, feed)
        return logits

    def sample(self, logits: dict[int, np.ndarray],
               failed: Callable[[Request, Exception], None] | None = None) -> list[tuple[Request, TokenEvent]]:
        """The next token of every request whose prompt is in (from feed's logits). With `failed`,
        a request whose sampling raises (its sampler, constraint or reply parser) leaves the batch
        and is reported there; the others are sampled as if it had never been in it."""
        events = []
        for r in list(self._requests):
            if r.todo or r.seq not in logits:  # more of its prompt to prefill
                continue
            r.prefilling = False
            if failed is None:
                events.append((r, self._sample(r, logits[r.seq])))
                continue
            try:
                events.append((r, self._sample(r, logits[r.seq])))
            except Exception as exc:  # noqa: BLE001 - one request's fault is that request's only
                if r in self._requests:
                    self._requests.remove(r)
                failed(r, exc)
        return events

    def _next_input(self, r: Request) -> Run:
        run = r.todo[0]
        n = min(self.prefill_chunk, len(run)) if r.prefilling else len(run)
        r.todo = ([run[n:]] if n < len(run) else []) + r.todo[1:]
        r.reply.pending = None
        return run[:n]

    def _account(self, seconds: float, feed: dict[int, Run]) -> None:
        prefill = sum(len(v) for r in self._requests if r.prefilling for v in [feed[r.seq]])
        decode = sum(len(feed[r.seq]) for r in self._requests if not r.prefilling)
        share = seconds / max(1, prefill + decode)
        self.timings.prompt_s += share * prefill
        self.timings.prompt_tokens += prefill
        self.timings.eval_s += share * decode
        self.timings.eval_runs += 1 if decode else 0

    def _room(self, r: Request) -> int:
        """The tokens a request may still sample, this one included (-n / max_tokens, the context)."""
        room = self.model.n_ctx - self.model.seq_pos(r.seq) - 1
        return min(room, r.stop.n_predict - len(r.reply.tokens)) if r.stop.n_predict >= 0 else room

    def _sample(self, r: Request, logits: np.ndarray) -> TokenEvent:
        t = time.perf_counter()
        masked = logits if r.constraint is None else r.constraint.mask(logits, self._room(r))
        token = r.sampler(masked)
        if r.constraint is not None:
            r.constraint.accept(token)
        lp = log_softmax(logits) if r.logprobs >= 0 else None  # the model's own distribution
        self.timings.sample_s += time.perf_counter() - t
        self.timings.samples += 1
        r.sampler.accept([token])
        reply = r.reply
        reply.tokens.append(token)
        reply.pending = token
        if token in r.stop.eog:
            reply.reason = "eog"
            piece = r.decoder.flush()
        else:
            piece = r.decoder.push(token) if r.show(token) else ""
            reply.reason = stop_reason(reply.text + piece, len(piece), len(reply.tokens), r.stop,
                                       self.model.seq_pos(r.seq) >= self.model.n_ctx)
            if reply.reason:
                piece += r.decoder.flush()
        reply.text += piece
        if reply.reason:
            self._requests.remove(r)
        else:
            r.todo = [[token]]
        return TokenEvent(token, piece, None if lp is None else float(lp[token]),
                          top_logprobs(lp, r.logprobs) if lp is not None else None, reply.reason or None)
