"""Token sampling from one row of logits: repeat, presence and frequency penalties, temperature,
top-k, top-p, min-p, seeded RNG.

The filters run in llama.cpp's default sampler order (the penalties over the last
repeat_last_n accepted tokens, then top-k, top-p, min-p on the untempered distribution, then
temperature, then a draw; a temperature <= 0 takes the best token after the penalty), with
llama-cli's defaults and its meaning of "off" for each one, so that the same flags mean the same
thing in both runners. Suppressed tokens (--ignore-eos: the EOS) are never drawn.

Any finite parameter gives a token, never NaN: a penalty saturates a logit at float32's largest
magnitude (a -inf logit is only ever a token that may not be drawn), and the temperature divides
the logits' distances to the best one in float64 (a temperature of 1e-300 is as good as greedy,
1e300 as good as uniform over what the filters kept).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# llama-cli's defaults (common/common.h).
DEFAULT_TEMP = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_REPEAT_PENALTY = 1.0  # off
DEFAULT_REPEAT_LAST_N = 64
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SamplingParams:
    temp: float = DEFAULT_TEMP  # <= 0: greedy (argmax)
    top_k: int = DEFAULT_TOP_K  # <= 0: off
    top_p: float = DEFAULT_TOP_P  # >= 1: off
    min_p: float = DEFAULT_MIN_P  # <= 0: off
    seed: int | None = None  # None: a fresh seed from the OS
    repeat_penalty: float = DEFAULT_REPEAT_PENALTY  # 1.0: off
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N  # 0: off; the window of accepted tokens penalised
    presence_penalty: float = 0.0  # 0: off; subtracted once from each token in the window
    frequency_penalty: float = 0.0  # 0: off; subtracted once per occurrence in the window
    suppress: frozenset[int] = frozenset()  # token ids never sampled
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit): OpenAI's logit_bias

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


def _probs(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - np.max(logits)
    p = np.exp(z)
    return p / p.sum()


def tempered_probs(logits: np.ndarray, temp: float) -> np.ndarray:
    """softmax(logits / temp) for any temp > 0: the float32 quotient as llama.cpp divides when it
    is finite (the same draws as ever), else the distances to the largest logit over temp in
    float64 (a temp float32 rounds to 0 or inf, a quotient that overflows)."""
    with np.errstate(all="ignore"):
        scaled = logits / np.float32(temp)
        if np.isfinite(np.max(scaled)) and not np.isnan(scaled).any():
            return _probs(scaled)
        p = np.exp((logits.astype(np.float64) - np.max(logits)) / temp)
    return p / p.sum()


def _saturate(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The allowed tokens' logits within float32's finite range (a penalty of 1e-30 or 1e30 moves
    a logit there, not to +-inf); the others -inf."""
    return np.where(allowed, np.clip(logits, -FLOAT32_MAX, FLOAT32_MAX), -np.inf).astype(np.float32)


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (ties at the boundary: lower token id wins), -inf elsewhere."""
    if k <= 0 or k >= logits.size:
        return logits
    # A stable sort on -logits keeps equal logits in id order, so ties resolve deterministically.
    keep = np.argsort(-logits, kind="stable")[:k]
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability mass reaches p."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    cum = np.cumsum(_probs(logits)[order])
    # The token that crosses p is kept (as llama.cpp does), and at least one always is.
    n_keep = int(np.searchsorted(cum, p, side="left")) + 1
    out = np.full_like(logits, -np.inf)
    keep = order[:n_keep]
    out[keep] = logits[keep]
    return out


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if min_p <= 0.0:
        return logits
    # p_i / p_max = exp(l_i - l_max): no normalisation needed.
    keep = logits >= np.max(logits) + np.log(min_p)
    return np.where(keep, logits, -np.inf).astype(logits.dtype)


def repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """llama.cpp's repetition penalty: each distinct recent token's logit divided by `penalty` when
    positive, multiplied by it otherwise (so it always moves towards less likely)."""
    if penalty == 1.0 or not recent:
        return logits
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    out = logits.copy()
    hit = out[ids]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # saturated by the caller
        out[ids] = np.where(hit > 0, hit / np.float32(penalty), hit * np.float32(penalty))
    return out


def presence_frequency_penalty(logits: np.ndarray, recent: Sequence[int], presence: float,
                               frequency: float) -> np.ndarray:
    """llama.cpp's (and OpenAI's) additive penalties: each recent token's logit less `presence`
    once and `frequency` times the number of its occurrences in the window."""
    if (presence == 0.0 and frequency == 0.0) or not recent:
        return logits
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    out = logits.copy()
    out[ids] -= (np.float32(presence) + np.float32(frequency) * counts).astype(np.float32)
    return out


class Sampler:
    """Draws token ids from logits rows; one RNG per sampler, so a seed fixes the whole run. The
    tokens it is told about (`accept`: the prompt's and its own) feed the repeat penalty."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        self._recent: deque[int] = deque(maxlen=max(params.repeat_last_n, 0))

    def accept(self, tokens: Sequence[int]) -> None:
        self._recent.extend(tokens)

    def reset(self) -> None:
        """Forget the accepted tokens (a new turn), as llama-cli does; the RNG goes on."""
        self._recent.clear()

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float32).reshape(-1)
        if self.params.suppress or self.params.bias:
            logits = logits.copy()
            for token, value in self.params.bias:
                logits[token] += np.float32(value)
            logits[list(self.params.suppress)] = -np.inf
        allowed = np.isfinite(logits)
        if not allowed.any():
            raise ValueError("no token may be sampled: every one is suppressed or banned")
        logits = repeat_penalty(logits, self._recent, self.params.repeat_penalty)
        logits = presence_frequency_penalty(logits, self._recent, self.params.presence_penalty,
                                            self.params.frequency_penalty)
        logits = _saturate(logits, allowed)
        if self.params.greedy:
            return int(np.argmax(logits))
        logits = top_k_filter(logits, self.params.top_k)
        logits = top_p_filter(logits, self.params.top_p)
        logits = min_p_filter(logits, self.params.min_p)
        probs = tempered_probs(logits, self.params.temp)
        return int(self._rng.choice(probs.size, p=probs))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The model's log-probabilities of one logits row (float64, before any sampling filter)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    z = z - np.max(z)
    return z - np.log(np.exp(z).sum())


def top_logprobs(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n most likely (token, logprob), most likely first; ties: the lower id first."""
    if n <= 0:
        return []
    order = np.argsort(-logprobs, kind="stable")[:n]
    return [(int(i), float(logprobs[i])) for i in order]
