"""Token sampling from one row of logits: temperature, top-k, top-p, min-p, seeded RNG.

The filters run in llama.cpp's default sampler order (top-k, top-p, min-p on the untempered
distribution, then temperature, then a draw), with llama-cli's defaults and its meaning of
"off" for each one, so that the same flags mean the same thing in both runners.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# llama-cli's defaults (common/common.h).
DEFAULT_TEMP = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05


@dataclass(frozen=True)
class SamplingParams:
    temp: float = DEFAULT_TEMP  # <= 0: greedy (argmax)
    top_k: int = DEFAULT_TOP_K  # <= 0: off
    top_p: float = DEFAULT_TOP_P  # >= 1: off
    min_p: float = DEFAULT_MIN_P  # <= 0: off
    seed: int | None = None  # None: a fresh seed from the OS

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


def _probs(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - np.max(logits)
    p = np.exp(z)
    return p / p.sum()


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


class Sampler:
    """Draws token ids from logits rows; one RNG per sampler, so a seed fixes the whole run."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float32).reshape(-1)
        if self.params.greedy:
            return int(np.argmax(logits))
        logits = top_k_filter(logits, self.params.top_k)
        logits = top_p_filter(logits, self.params.top_p)
        logits = min_p_filter(logits, self.params.min_p)
        probs = _probs(logits / np.float32(self.params.temp))
        return int(self._rng.choice(probs.size, p=probs))
