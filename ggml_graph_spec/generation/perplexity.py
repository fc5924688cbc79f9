"""Perplexity by llama-perplexity's chunked method, so the numbers compare with llama.cpp's.

The token stream is cut into `n_chunks` non-overlapping chunks of `n_ctx` tokens; each chunk is
evaluated from an empty cache with its first token replaced by BOS (when the vocabulary adds
one), and only the second half of each chunk is scored, so every scored token has at least
n_ctx/2 tokens of context. The estimated error is the standard error of the mean negative
log-likelihood carried through exp(), as llama-perplexity prints it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from gguf_arch.errors import KimiError

# evaluate(tokens of one chunk) -> logits [len(tokens), n_vocab], starting from an empty cache
ChunkEvaluator = Callable[[list[int]], np.ndarray]


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    error: float  # +/- one standard error of the PPL estimate
    n_chunks: int
    n_ctx: int
    n_scored: int  # tokens scored over all chunks
    running: tuple[float, ...]  # PPL after each chunk, as llama-perplexity prints [i]ppl

    def final_line(self) -> str:
        return f"Final estimate: PPL = {self.ppl:.4f} +/- {self.error:.5f}"


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] per row, in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return log_norm - z[np.arange(len(targets)), targets]


MIN_PERPLEXITY_CTX = 4  # a chunk's second half is scored: at least two tokens of context, two scored


def chunk_count(n_tokens: int, n_ctx: int, n_chunks: int) -> int:
    """How many chunks llama-perplexity evaluates (n_chunks < 0: as many as fit)."""
    if n_ctx < MIN_PERPLEXITY_CTX:
        raise KimiError(f"perplexity: context size {n_ctx} is too small: need -c {MIN_PERPLEXITY_CTX} or more")
    if n_tokens < 2 * n_ctx:
        raise KimiError(f"perplexity: the text tokenizes to {n_tokens} tokens; need at least "
                        f"{2 * n_ctx} (2 x -c {n_ctx}): give a longer -f file or a smaller -c")
    fit = n_tokens // n_ctx
    return fit if n_chunks < 0 else min(n_chunks, fit)


def perplexity(tokens: Sequence[int], n_ctx: int, evaluate: ChunkEvaluator, *, bos: int | None,
               n_chunks: int = -1, on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """Chunked perplexity of `tokens`; `on_chunk(i, running_ppl)` is called after each chunk."""
    n = chunk_count(len(tokens), n_ctx, n_chunks)
    first = n_ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    running = []
    for i in range(n):
        chunk = [int(t) for t in tokens[i * n_ctx:(i + 1) * n_ctx]]
        targets = np.asarray(chunk[first + 1:])
        if bos is not None:
            chunk[0] = bos
        logits = np.asarray(evaluate(chunk))
        nll = token_nll(logits[first:n_ctx - 1], targets)
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += len(nll)
        running.append(float(np.exp(nll_sum / count)))
        if on_chunk is not None:
            on_chunk(i, running[-1])
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = float(np.exp(mean))
    error = float(np.sqrt(var / (count - 1)) * ppl) if var > 0 else 0.0
    return PerplexityResult(ppl, error, n, n_ctx, count, tuple(running))
