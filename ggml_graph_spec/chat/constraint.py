"""What one sequence's next token may be: a grammar's mask, a reasoning budget's forced closer, and
the lazy start of the tools section; one Constraint per request, applied to its logits row before
sampling and told every sampled token after.

    plan = ConstraintPlan.build(tokenizer, spec, budget=256)    # in the request's thread: compiles
    c = Constraint(plan)                                        # in the engine, per sequence
    logits = c.mask(logits); token = sample(logits); c.accept(token)

* a full grammar (grammar.reply_grammar) runs from the first token: tool_choice required or named,
  a response format, a grammar of the caller's;
* tool_choice auto is lazy: free text until `<|open|>` is sampled in the response channel (or after
  it), then the tools section's grammar (grammar.tools_grammar) from the next token on;
* no tools allowed (none, or none declared) and nothing else enforced: `<|open|>` is never sampled
  in or after the response channel (it could only open a tools section);
* a reasoning budget of N tokens: once the think channel has N tokens, the next ones are forced to
  the budget message (if any) and `<|close|>think<|sep|>`; 0 closes it at once;
* ending in time: a grammar's reply near its token limit is steered to a valid end (closing.py).

llguidance computes each mask; the matcher of a request is compiled in the request's worker
thread (bounded by LIMITS), so a step of the engine never waits for a compilation.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
import numpy as np

from gguf_arch.arch import xtml

from ..text.tokenizer import BPETokenizer
from .closing import Bits, EndInTime
from .grammar import ReplySpec, reply_grammar, tools_grammar
from .reply import ReplyParser
from .vocab import ll_tokenizer

# The most a grammar may cost to build and to run a step (llguidance's own limits, made stricter
# where a hostile schema could make a request slow): its size in symbols and the lexer's work.
MAX_GRAMMAR_SYMBOLS = 400_000
MAX_LEXER_STATES = 100_000
STEP_LEXER_FUEL = 400_000


_POSITION = re.compile(r"^at \d+\(\d+\): ")


class GrammarError(ValueError):
    """A grammar (a schema, a tool declaration, a grammar text) that cannot be used."""


def first_error_line(error: str) -> str:
    """llguidance's first line of an error, without its position in the grammar this package wrote
    around the caller's schema or grammar."""
    first = next((line for line in error.splitlines() if line.strip()), "")
    return _POSITION.sub("", first.strip())[:300]


def grammar_limits():
    import llguidance
    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, max_lexer_states=MAX_LEXER_STATES,
                                     step_lexer_fuel=STEP_LEXER_FUEL, verbose_errors=False)


def compile_grammar(tokenizer: BPETokenizer, grammar: str, what: str):
    """A fresh llguidance matcher of `grammar`; GrammarError naming `what` when it cannot be built."""
    import llguidance
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0, limits=grammar_limits())
    if matcher.is_error():
        raise GrammarError(f"{what}: {first_error_line(matcher.get_error())}")
    return matcher


@dataclass
class ConstraintPlan:
    """A request's constraint, compiled: what Constraint runs."""

    start: str  # think | response | text
    full: object | None = None  # a matcher from the first token
    lazy: object | None = None  # the tools section's matcher, started by `<|open|>`
    ban_open: bool = False
    budget: int = -1  # think tokens before the closer is forced; -1: no budget
    closer: tuple[int, ...] = ()  # the budget message and `<|close|>think<|sep|>`, as tokens

    @classmethod
    def build(cls, tokenizer: BPETokenizer, spec: ReplySpec | None, *, start: str = "response",
              budget: int = -1, budget_message: str = "", grammar: str | None = None) -> "ConstraintPlan | None":
        """The plan of a chat reply (`spec`) or of a raw completion constrained by `grammar`;
        None when nothing constrains it."""
        if spec is None:
            full = compile_grammar(tokenizer, grammar, "grammar") if grammar is not None else None
            return cls("text", full=full) if full is not None else None
        plan = cls(spec.start, budget=budget if spec.start == "think" else -1)
        if spec.constrained:
            plan.full = compile_grammar(tokenizer, reply_grammar(spec), "the reply's grammar")
        elif spec.lazy:
            plan.lazy = compile_grammar(tokenizer, tools_grammar(spec.tools, spec.choice), "the tools' grammar")
        else:
            plan.ban_open = spec.start in ("think", "response")
        if plan.budget >= 0:
            closer = tokenizer.encode(budget_message + xtml.closing(xtml.THINK), add_bos=False)
            plan.closer = tuple(closer)
        if plan.full is None and plan.lazy is None and not plan.ban_open and plan.budget < 0:
            return None
        return plan


class Constraint:
    """One sequence's constraint while it generates."""

    def __init__(self, plan: ConstraintPlan, tokenizer: BPETokenizer) -> None:
        self.plan = plan
        self._tok = tokenizer
        self._open = tokenizer.special_id(xtml.OPEN)
        self._eos = tokenizer.eos_id
        self._channels = ReplyParser(tokenizer, plan.start)  # which channel the reply is in
        self._matcher = plan.full
        self._forced: deque[int] = deque()
        self._think_tokens = 0
        self._budget_spent = plan.budget < 0
        self.error = ""
        self._bits: Bits | None = None
        self._end: EndInTime | None = None
        if plan.budget == 0:
            self._force_closer()

    def _force_closer(self) -> None:
        self._budget_spent = True
        self._forced.extend(self.plan.closer)

    # ---- masking ---------------------------------------------------------------------------------
    def mask(self, logits: np.ndarray, room: int | None = None) -> np.ndarray:
        """`logits` with every token this constraint forbids at -inf (a copy when changed); `room`:
        the tokens the reply may still take (None: no limit)."""
        if self._forced and self._may_force():
            return _only(logits, self._forced[0])
        if self._matcher is not None:
            return self._grammar_mask(logits, room)
        if self.plan.ban_open and self._after_response() and self._open is not None:
            out = logits.copy()
            out[self._open] = -np.inf
            return out
        return logits

    def _may_force(self) -> bool:
        """Whether the forced closer may start now: under a grammar, not before the grammar takes
        its first token (a multi-byte character the think text is in the middle of is finished
        first; forcing the marker there would break the grammar). Once started, it goes on."""
        started = len(self._forced) < len(self.plan.closer)
        if started:
            return True
        if self._channels.mid_character:  # never close a channel inside a character, grammar or not
            return False
        return self._matcher is None or self._matcher.validate_tokens([self._forced[0]]) == 1

    def _after_response(self) -> bool:
        ch = self._channels.channel
        return ch == "response" or (ch == "between" and self._channels.responded)

    def _grammar_mask(self, logits: np.ndarray, room: int | None) -> np.ndarray:
        n = logits.shape[-1]
        if self._bits is None:
            self._bits, self._end = Bits(n), EndInTime(self._tok, n)
        bits = self._bits.fill(self._matcher)
        if bits.lowest() is None:  # it cannot go on (it never should): end the reply
            self.error = self.error or (self._matcher.get_error() or "the grammar allows no token")
            return _only(logits, self._eos)
        banned: list[int] = []
        if room is not None:
            token, banned = self._end.steer(self._matcher, bits, room)
            if token is not None:
                return _only(logits, token)
        allowed = bits.array()
        allowed[banned] = False
        return np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)

    # ---- accepting -------------------------------------------------------------------------------
    def accept(self, token: int) -> None:
        """The token sampled under this constraint's mask."""
        before = self._after_response()
        if self._forced and token == self._forced[0]:
            self._forced.popleft()
        if self._matcher is not None and not self._matcher.consume_token(token):
            self.error = self.error or self._matcher.get_error() or f"token {token} is not in the grammar"
        self._channels.feed(token)
        self._channels.take()  # only its channel is wanted here
        # Only the think channel's text counts: a marker the model wrote (its own `<|close|>think`
        # under way) is not thinking, and forcing the closer inside that tag would break it.
        if self._channels.channel == "think" and not self._channels.in_tag and not self._budget_spent:
            self._think_tokens += 1
            if self._think_tokens >= self.plan.budget:
                self._force_closer()
        if self.plan.lazy is not None and self._matcher is None and token == self._open and before:
            self._matcher = self.plan.lazy  # the tools section: its grammar starts after this marker

    @property
    def in_think(self) -> bool:
        return self._channels.channel == "think"


def _only(logits: np.ndarray, token: int) -> np.ndarray:
    out = np.full_like(logits, -np.inf)
    out[token] = logits[token] if np.isfinite(logits[token]) else 0.0
    return out

