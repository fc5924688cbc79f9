"""What a model call returns beyond the logits, and how per-batch results are joined."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..graph import taps
from ..graph.build import GraphBuild

WANTS = frozenset({"hidden", "attn_input", "index_selected", "index_scores", "moe", taps.MOE_NORMS, taps.IMATRIX})


@dataclass
class EvalResult:
    """One call's outputs; everything but `logits` only when asked for with `want`."""

    logits: np.ndarray  # [n_tokens, vocab]
    hidden: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, n_embd]
    attn_input: dict[int, np.ndarray] = field(default_factory=dict)  # MLA layer -> its normed input [n_tokens, n_embd]
    index_selected: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, k]
    index_scores: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, n_kv]
    moe_experts: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, k], ascending
    moe_weights: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, k], same order
    moe_norms: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, k], same order (taps.py)
    # weight name -> sum over the call's tokens of its input squared, [n_mat, ne0] (taps.py)
    imatrix: dict[str, np.ndarray] = field(default_factory=dict)


# Padding when joining per-batch rows of different widths (the visible context grows).
_JOIN_FILL = {"index_selected": -1, "index_scores": -np.inf}


def join_results(parts: list[EvalResult]) -> EvalResult:
    """Per-batch results as one: rows concatenated, short rows padded (-1 / -inf)."""
    out = EvalResult(np.concatenate([p.logits for p in parts]))
    out.imatrix = {name: sum(p.imatrix[name] for p in parts) for name in parts[0].imatrix}
    for name in ("hidden", "attn_input", "index_selected", "index_scores", "moe_experts", "moe_weights", "moe_norms"):
        for layer in getattr(parts[0], name):
            rows = [getattr(p, name)[layer] for p in parts]
            width = max(r.shape[1] for r in rows)
            fill = _JOIN_FILL.get(name, 0)
            getattr(out, name)[layer] = np.concatenate(
                [np.pad(r, ((0, 0), (0, width - r.shape[1])), constant_values=fill) for r in rows])
    return out


def _fixture_selection(sel: np.ndarray, n_past: int, width: int) -> np.ndarray:
    """Rows of selected positions -> visible ones only, ascending, padded with -1 to `width`."""
    out = np.full((sel.shape[0], width), -1, dtype=np.int32)
    for t, row in enumerate(sel):
        kept = np.sort(row[row <= n_past + t])
        out[t, :len(kept)] = kept
    return out


def collect(g: GraphBuild, logits: np.ndarray, read) -> EvalResult:
    """The outputs of a computed single-sequence graph: the logits and every record, read with
    `read` (the executor's), the MoE ones in ascending expert id as the fixtures hold them."""
    r = EvalResult(logits)
    for (what, layer), t in g.records.items():
        a = read(t)
        if what == "index_selected":
            a = _fixture_selection(a, g.n_past, a.shape[-1])
        elif what == "moe_weights":
            a = a.reshape(g.n_tokens, -1)
        getattr(r, what)[layer] = a  # every record is named as its field
    for layer, experts in r.moe_experts.items():  # report in ascending expert id, as the fixture
        order = np.argsort(experts, axis=1, kind="stable")
        r.moe_experts[layer] = np.take_along_axis(experts, order, 1)
        r.moe_weights[layer] = np.take_along_axis(r.moe_weights[layer], order, 1)
        if layer in r.moe_norms:
            r.moe_norms[layer] = np.take_along_axis(r.moe_norms[layer], order, 1)
    return r
