"""What a model call takes: per sequence, token ids or embedding rows (an image's, say), checked
whole before anything runs, cut into micro-batches, and made into the graph's input.

A sequence's new input is token ids (ints) or rows of embeddings, float32 [n, n_embd], that take
the place of the token embedding at those positions (llama.cpp's `llama_batch.embd`); a sequence
records EMBEDDING_POS for each position fed as a row (`Model.seq_tokens`).
"""
from __future__ import annotations


import ggml
import numpy as np

from gguf_arch.arch.config import K3Config
from gguf_arch.arch.tensors import TOKEN_EMBD
from gguf_arch.errors import KimiError

from ..graph.build import F32, I32, GraphBuild
from ..graph.ubatch import UBatch

EMBEDDING_POS = -1


class EvalError(KimiError):
    """A request the loaded model cannot serve (token ids, sequence ids, context length)."""


def is_rows(x: np.ndarray) -> bool:
    return x.dtype == np.float32


def check_input(seq: int, value, cfg: K3Config) -> np.ndarray:
    """One sequence's input as int32 token ids or float32 rows [n, n_embd]."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        rows = np.ascontiguousarray(value, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != cfg.hidden_size or not len(rows):
            raise EvalError(f"embedding rows for sequence {seq} must be [n >= 1, {cfg.hidden_size}], got "
                            f"{list(value.shape)}")
        if not np.isfinite(rows).all():
            raise EvalError(f"embedding rows for sequence {seq} hold a non-finite value")
        return rows
    ids = np.asarray(value, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise EvalError(f"no tokens to evaluate for sequence {seq}")
    bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
    if bad.size:
        raise EvalError(f"token id {int(bad[0])} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    return ids.astype(np.int32)


def take(todo: list[tuple[int, np.ndarray]], budget: int) -> tuple[list, list]:
    """The next micro-batch: up to `budget` positions, as many sequences as fit, a long input cut
    (its rest goes on in the next one); and what is left."""
    chunk, rest = [], []
    for seq, x in todo:
        n = min(len(x), budget)
        if n:
            chunk.append((seq, x[:n]))
            budget -= n
        if n < len(x):
            rest.append((seq, x[n:]))
    return chunk, rest


def recorded(x: np.ndarray) -> list[int]:
    """What a sequence's history records for an input: its token ids, or EMBEDDING_POS per row."""
    return [EMBEDDING_POS] * len(x) if is_rows(x) else [int(t) for t in x]


def embedded(g: GraphBuild, weights, ubatch: UBatch, values: dict[int, np.ndarray]):
    """The micro-batch's input columns [n_embd, T]: the token embeddings (one get_rows for all the
    tokens, as a batch of tokens only has always read them), with embedding rows in their runs'
    places (copies, no arithmetic: a row goes in bit for bit)."""
    runs = ubatch.runs
    if not any(is_rows(values[r.seq]) for r in runs):
        ids = ubatch.layout(values)
        return ggml.ggml_get_rows(g.ctx, weights.tensors[TOKEN_EMBD], g.input("tokens", I32, (len(ids),), ids))
    out = None
    for r in runs:
        x = values[r.seq]
        if is_rows(x):
            part = g.input(f"embd.{r.seq}", F32, (x.shape[1], len(x)), x)
        else:
            part = ggml.ggml_get_rows(g.ctx, weights.tensors[TOKEN_EMBD], g.input(f"tokens.{r.seq}", I32, (len(x),), x))
        out = part if out is None else ggml.ggml_concat(g.ctx, out, part, 1)
    return out
