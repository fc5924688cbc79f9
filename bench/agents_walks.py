"""The constraint walks of bench/agents.py: the project's Constraint driven token by token, as
generation/batch.py drives it (mask the logits row, sample, accept), every mask and accept timed.

  reply walk    a valid reply (bench/agents_specs.py), tokenized: each step the row's largest
                logit is the reply's next token, so the sampled token is that one if the mask
                allows it (a mask that refuses a token of a valid reply stops the run). No limit.
  closing walk  a valid reply's tokens up to the middle of its constrained section (the tools
                section, the JSON), then a model that does not end by itself (fresh random logits
                each step, the largest allowed one taken) with a `room` that runs down from
                MAX_LOOKAHEAD to 1: closing.py's look-ahead steers it to a valid end. Each reply
                is checked: it must end (`<|end_of_msg|>`) within the room and parse to what the
                request allows; one that does not is counted, with its last text.

Times: the wall clock and this thread's CPU time (time.thread_time: the computation's own on a
shared machine), in µs. The split of a mask's time is measured on a second pass of the same walk
with the clock inside (split_clock): llguidance's computation of the mask (Bits.fill), the
closing look-ahead (EndInTime.steer, the masks it computes on its copies included) and the rest,
numpy's application of the bits to the row.
"""
from __future__ import annotations

import json
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from bench import agents_specs as specs
from bench import grammar_specs as gs
from bench.grammar_walks import summary
from ggml_graph_spec.chat.closing import MAX_LOOKAHEAD, Bits, EndInTime
from ggml_graph_spec.chat.constraint import Constraint, ConstraintPlan
from ggml_graph_spec.chat.grammar import JsonSchema, ReplySpec
from ggml_graph_spec.chat.reply import ReplyParser

BIG = np.float32(1e4)  # the reply's next token's logit: above any of the row's others
CONSTRAINED = {"tools", "json"}


class WalkError(RuntimeError):
    """A constraint refused a valid reply, or a closing walk did not end valid."""


@dataclass
class Steps:
    """Per step: the section, and the mask's and the accept's wall and CPU µs."""

    section: list[str] = field(default_factory=list)
    mask_wall: list[float] = field(default_factory=list)
    mask_cpu: list[float] = field(default_factory=list)
    accept_wall: list[float] = field(default_factory=list)
    accept_cpu: list[float] = field(default_factory=list)

    def add(self, other: "Steps") -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))

    def figures(self, which: set[str] | None = None) -> dict:
        """mask + accept per step (wall and CPU), and each alone, over the steps of sections `which`."""
        keep = [i for i, s in enumerate(self.section) if which is None or s in which]
        pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
        wall = [m + a for m, a in zip(pick(self.mask_wall), pick(self.accept_wall))]
        cpu = [m + a for m, a in zip(pick(self.mask_cpu), pick(self.accept_cpu))]
        if not keep:
            return {"n": 0}
        return {"n": len(keep), "mask_accept_us": summary(wall), "mask_accept_cpu_us": summary(cpu),
                "mask_cpu_us": summary(pick(self.mask_cpu)), "accept_cpu_us": summary(pick(self.accept_cpu))}


def _clocked(fn):
    w, c = time.perf_counter(), time.thread_time()
    out = fn()
    return out, (time.perf_counter() - w) * 1e6, (time.thread_time() - c) * 1e6


def step(c: Constraint, logits: np.ndarray, room: int | None, steps: Steps, section: str,
         want: int | None = None) -> int:
    """One sampling step under the constraint, timed: the token taken (`want` if given and
    allowed, else the largest allowed logit)."""
    masked, mw, mc = _clocked(lambda: c.mask(logits, room))
    token = int(np.argmax(masked))
    if want is not None and token != want:
        raise WalkError(f"the mask refused token {want} ({section}) of a valid reply: {c.error or 'not allowed'}")
    _, aw, ac = _clocked(lambda: c.accept(token))
    if c.error:
        raise WalkError(f"the constraint's grammar failed ({section}): {c.error}")
    steps.section.append(section)
    steps.mask_wall.append(mw)
    steps.mask_cpu.append(mc)
    steps.accept_wall.append(aw)
    steps.accept_cpu.append(ac)
    return token


def encode(tokenizer, pieces: list[tuple[str, str]]) -> list[tuple[str, int]]:
    """(section, token) of a reply's pieces, each encoded alone (they meet at special tokens)."""
    return [(section, t) for section, text in pieces for t in tokenizer.encode(text, add_bos=False)]


class Walk:
    """One sequence's constraint along valid replies, one reply after another, each a request of
    its own: its plan compiled anew (a matcher is consumed by its reply) and its Constraint made
    outside the timed steps, as a request's are before it joins the batch."""

    def __init__(self, spec: ReplySpec, tokenizer, lexicon: list[str], seed: int) -> None:
        self.spec, self.tok, self.lexicon = spec, tokenizer, lexicon
        self.rng = random.Random(seed)
        self.logits = np.random.default_rng(seed).standard_normal(tokenizer.vocab_size).astype(np.float32)
        self.replies = 0
        self._start()

    def _start(self) -> None:
        self.c = Constraint(ConstraintPlan.build(self.tok, self.spec), self.tok)
        self.todo = encode(self.tok, specs.reply(self.rng, self.lexicon, self.spec))
        self.replies += 1

    def step(self, steps: Steps) -> bool:
        """The reply's next token; True when that ended the reply (the next step starts another)."""
        section, token = self.todo.pop(0)
        saved, self.logits[token] = self.logits[token], BIG
        try:
            step(self.c, self.logits, None, steps, section, want=token)
        finally:
            self.logits[token] = saved
        if not self.todo:
            self._start()
            return True
        return False


class ClosingWalk:
    """A reply from the middle of its constrained section to its end within MAX_LOOKAHEAD tokens
    (the module's docstring), then another, each checked and each a request of its own (Walk)."""

    def __init__(self, spec: ReplySpec, tokenizer, lexicon: list[str], seed: int) -> None:
        self.spec, self.tok, self.lexicon = spec, tokenizer, lexicon
        self.rng, self.noise = random.Random(seed), np.random.default_rng(seed)
        self.walks, self.lookahead_from = 0, []
        self.failures: list[str] = []  # the walks that did not end valid: why, and how they ended
        self._start()

    def _start(self) -> None:
        seq = encode(self.tok, specs.reply(self.rng, self.lexicon, self.spec))
        where = [i for i, (s, _) in enumerate(seq) if s in CONSTRAINED]
        cut = where[len(where) // 2]
        self.c, self.tokens = Constraint(ConstraintPlan.build(self.tok, self.spec), self.tok), []
        self.room = MAX_LOOKAHEAD
        base = self.noise.standard_normal(self.tok.vocab_size).astype(np.float32)
        for _section, token in seq[:cut]:  # the way there: not timed
            saved, base[token] = base[token], BIG
            step(self.c, base, None, Steps(), "prefix", want=token)
            base[token] = saved
            self.tokens.append(token)
        self.lookahead_from.append(seq[cut][0])
        self.walks += 1

    def step(self, steps: Steps) -> bool:
        logits = self.noise.standard_normal(self.tok.vocab_size).astype(np.float32) * 4
        token = step(self.c, logits, self.room, steps, "closing")
        self.tokens.append(token)
        self.room -= 1
        if token == self.tok.eos_id or self.room == 0:
            self.check()
            self._start()
            return True
        return False

    def check(self) -> None:
        """A walk that did not end valid is the constraint's failure, not the benchmark's: counted
        and kept (a few) with the reply's last tokens."""
        why = None
        if self.tokens[-1] != self.tok.eos_id:
            why = f"did not end within {MAX_LOOKAHEAD} tokens"
        else:
            why = reply_error(self.tok, self.spec, self.tokens)
        if why:
            self.failures.append(f"{why}: ...{self.tok.decode(self.tokens[-MAX_LOOKAHEAD:])[-300:]!r}")


def reply_error(tokenizer, spec: ReplySpec, tokens: list[int]) -> str | None:
    """Why a whole reply is not what the request allows (None: it is)."""
    p = ReplyParser(tokenizer, spec.start, spec.tools)
    for t in tokens:
        p.feed(t)
    r = p.finish()
    if r.error or r.open_call:
        return r.error or "a call left open"
    if isinstance(spec.response, JsonSchema):
        try:
            return gs.schema_error(json.loads(r.content), spec.response.schema)
        except ValueError as e:
            return f"the content is not JSON: {e}"
    if not r.tool_calls:
        return "no tool call"
    return specs.check_calls(r.tool_calls, list(spec.tools))


def run_steps(walks: list, n_steps: int) -> tuple[Steps, list[float], list[float]]:
    """`n_steps` steps of every walk in turn (batch.py's order: one sequence after another); the
    per-token steps of all, and per step the sum over the walks (wall, CPU µs)."""
    steps, per_step_wall, per_step_cpu = Steps(), [], []
    for _ in range(n_steps):
        mark = len(steps.section)
        for w in walks:
            w.step(steps)
        per_step_wall.append(sum(steps.mask_wall[mark:]) + sum(steps.accept_wall[mark:]))
        per_step_cpu.append(sum(steps.mask_cpu[mark:]) + sum(steps.accept_cpu[mark:]))
    return steps, per_step_wall, per_step_cpu


def run_replies(walk, n_replies: int) -> Steps:
    """The steps of `n_replies` whole replies (or closing walks) of one walk."""
    steps, done = Steps(), 0
    while done < n_replies:
        done += walk.step(steps)
    return steps


@contextmanager
def split_clock(into: dict) -> Iterator[dict]:
    """Thread CPU µs of the mask's parts, added to `into`: `fill` (llguidance's mask of the
    step), `lookahead` (closing's steer, with the masks of its copies), and counts: `steers`,
    `lookaheads` (walks of a copy to the end), `lookahead_masks` (masks computed on them)."""
    fill, steer, shortest = Bits.fill, EndInTime.steer, EndInTime.shortest
    for key in ("fill", "lookahead", "steers", "lookaheads", "lookahead_masks"):
        into.setdefault(key, 0)
    depth = [0]

    def fill_clocked(self, matcher):
        if depth[0]:
            into["lookahead_masks"] += 1
            return fill(self, matcher)
        t = time.thread_time()
        out = fill(self, matcher)
        into["fill"] += (time.thread_time() - t) * 1e6
        return out

    def steer_clocked(self, *args):
        depth[0] += 1
        t = time.thread_time()
        try:
            return steer(self, *args)
        finally:
            depth[0] -= 1
            into["lookahead"] += (time.thread_time() - t) * 1e6
            into["steers"] += 1

    def shortest_counted(self, *args, **kwargs):
        into["lookaheads"] += 1
        return shortest(self, *args, **kwargs)

    Bits.fill, EndInTime.steer, EndInTime.shortest = fill_clocked, steer_clocked, shortest_counted
    try:
        yield into
    finally:
        Bits.fill, EndInTime.steer, EndInTime.shortest = fill, steer, shortest

