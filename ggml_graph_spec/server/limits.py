"""The range of every numeric request field: what the engine can hold, checked before a request is
queued (protocol.py, agent.py) and said by the server's OpenAPI schema (openapi.py) from this one
table.

JSON's numbers have no size, and neither have Python's integers; the engine's counts and the
sampler's float32 arithmetic do. So:

* every integer field is at most 2^63 - 1 (int64; -2^63 at the other end), the seed at most
  2^64 - 1: a larger one is a 400 naming the field and its range, never an OverflowError;
* a count that means "up to the slot's context" or "up to the vocabulary" takes any value in its
  range and is clamped, with the meaning llama-server gives it (`repeat_last_n` -1 or past the
  context: the whole context; `top_k` past the vocabulary: all tokens; `max_tokens` past the
  context: until the context is full, finish_reason "length");
* every number is finite and within float32's range (|x| <= 3.4028235e38, what the sampler
  computes in); an integer too large for a float is a 400 too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..chat.reasoning import MAX_BUDGET
from .errors import bad_request

INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_BIAS = 100.0  # OpenAI's logit_bias range
# repeat_last_n -1 or past any slot's context: no slot holds more tokens than this (a deque of
# accepted tokens cannot be longer than the platform's ssize_t).
ALL_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    integer: bool
    meaning: str = ""  # what the edges and the special values mean
    open_low: bool = False  # low itself is out of range
    excluded: tuple[int, ...] = ()  # values inside [low, high] that are not in the range

    def schema(self) -> dict:
        """The JSON schema of the field's value."""
        out: dict = {"type": "integer" if self.integer else "number", "maximum": self.high}
        out["exclusiveMinimum" if self.open_low else "minimum"] = self.low
        if self.excluded:
            out["not"] = {"enum": list(self.excluded)}
        return out

    def holds(self, value: float) -> bool:
        return (value > self.low if self.open_low else value >= self.low) and value <= self.high and \
            value not in self.excluded

    def check(self, name: str, value: float) -> None:
        """400 naming the field and its range unless `value` is in it."""
        if value in self.excluded:
            raise bad_request(f"'{name}' may not be {value}: {self.meaning}")
        if not self.holds(value):
            raise bad_request(f"'{name}' must be {self._span(value)}, got {value}")

    def _span(self, value: float) -> str:
        ceiling = self.high in (INT64_MAX, FLOAT32_MAX)  # the type's bound, not the field's: named as such
        if ceiling and value <= self.low:  # the message of the side the value is on
            return f"> {self.low}" if self.open_low else f">= {self.low}"
        if ceiling:
            return f"<= {self.high}" + (" (int64)" if self.high == INT64_MAX else " (float32's largest)")
        return f"in [{self.low}, {self.high}]"

    def describe(self) -> str:
        low = f"({_show(self.low)}" if self.open_low else f"[{_show(self.low)}"
        but = f", not {', '.join(map(str, self.excluded))}" if self.excluded else ""
        return f"{'integer' if self.integer else 'number'} in {low}, {_show(self.high)}]{but}"


def _show(x: float) -> str:
    named = {INT64_MAX: "2^63-1", UINT64_MAX: "2^64-1", FLOAT32_MAX: "3.4e38"}
    return named.get(x, str(x) if isinstance(x, int) else f"{x:g}")


def _tokens(meaning: str) -> Range:
    return Range(-1, INT64_MAX, True, meaning, excluded=(0,))


_LIMIT = "at least 1, or -1: until the context is full; past the slot's context: until it is full (finish_reason " \
         "length)"
RANGES: dict[str, Range] = {
    "temperature": Range(0.0, FLOAT32_MAX, False, "0: greedy; 1e-30 as good as greedy, 1e30 as uniform"),
    "top_p": Range(0.0, 1.0, False, "1: off"),
    "min_p": Range(0.0, 1.0, False, "0: off"),
    "top_k": Range(0, INT64_MAX, True, "0 or past the vocabulary: off (every token)"),
    "seed": Range(-1, UINT64_MAX, True, "-1: a random one"),
    "repeat_penalty": Range(0.0, FLOAT32_MAX, False, "1: off; a logit it moves saturates at float32's range",
                            open_low=True),
    "repeat_last_n": Range(-1, INT64_MAX, True, "0: off; -1 or past the slot's context: the whole context"),
    "presence_penalty": Range(-2.0, 2.0, False, "0: off"),
    "frequency_penalty": Range(-2.0, 2.0, False, "0: off"),
    "max_tokens": _tokens(_LIMIT),
    "max_completion_tokens": _tokens(_LIMIT),
    "n_predict": _tokens(_LIMIT),
    "max_output_tokens": Range(1, INT64_MAX, True, "past the slot's context: until it is full (status incomplete)"),
    "top_logprobs": Range(0, MAX_TOP_LOGPROBS, True, "alternatives per token"),
    "logprobs": Range(0, MAX_TOP_LOGPROBS, True, "/v1/completions: alternatives per token (chat: true/false)"),
    "n": Range(1, 1, True, "one choice per request"),
    "reasoning_budget_tokens": Range(-1, MAX_BUDGET, True, "-1: no budget; 0: no thinking"),
    "thinking_budget_tokens": Range(-1, MAX_BUDGET, True, "as reasoning_budget_tokens"),
    "logit_bias": Range(-MAX_BIAS, MAX_BIAS, False, "per token id; -100 (or false): never sampled"),
}


def integer(name: str, value: int) -> int:
    """A checked integer field's value."""
    RANGES[name].check(name, value)
    return value


def number(name: str, value: int | float) -> float:
    """A checked number field's value as a float: finite, within float32 and the field's range."""
    try:
        x = float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise bad_request(f"'{name}' must be a {RANGES[name].describe()}, got an integer of "
                          f"{value.bit_length()} bits") from None
    if not math.isfinite(x):
        raise bad_request(f"'{name}' must be a finite number, got {x}")
    RANGES[name].check(name, x)
    return x


def window(repeat_last_n: int) -> int:
    """repeat_last_n as the sampler's window: -1 and counts past any context are the whole context."""
    return ALL_TOKENS if repeat_last_n < 0 or repeat_last_n > ALL_TOKENS else repeat_last_n


def markdown() -> str:
    """The table docs/reliability.md holds: each numeric field, its range and what its edges mean."""
    rows = ["| field | range | meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {r.describe()} | {r.meaning} |" for name, r in RANGES.items()]
    return "\n".join(rows)
