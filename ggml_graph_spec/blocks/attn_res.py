"""Attention Residuals (docs/reference/forward.md#attnres): each sublayer's input is a softmax mix of
the banked block residuals and the running partial sum, scored against a learned vector.

Layout (ggml `ne` order, one sequence): every value [n_embd, T]; the score vector [n_embd].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ggml

from ..graph.build import GraphBuild, Tensor


@dataclass
class ResidualBank:
    """The banked block residuals of one forward pass: raw values and their RMS-normed keys."""

    values: list[Tensor] = field(default_factory=list)
    keys: list[Tensor] = field(default_factory=list)

    def push(self, g: GraphBuild, p: Tensor) -> None:
        self.values.append(p)
        self.keys.append(ggml.ggml_rms_norm(g.ctx, p, g.cfg.rms_norm_eps))

    def __len__(self) -> int:
        return len(self.values)


def attn_res(g: GraphBuild, p: Tensor, bank: ResidualBank, score: Tensor) -> Tensor:
    """Softmax over [bank..., P] of (rmsnorm(V_j) . score), mixing the RAW values V_j
    (docs/reference/forward.md#attnres).

    `score` is the fused f32 vector norm_gain * pseudo_query ([n_embd]).
    """
    c = g.ctx
    values = bank.values + [p]
    keys = bank.keys + [ggml.ggml_rms_norm(c, p, g.cfg.rms_norm_eps)]
    # key . score as llama.cpp computes it, a mul and a sum_rows (which sums in double): a
    # mul_mat sums in another order, and the last bit it changes in the mix is enough to flip
    # activations across a BF16 rounding step in the next matmul.
    logits = None
    for key in keys:
        s = ggml.ggml_sum_rows(c, ggml.ggml_mul(c, key, score))  # [1, T] per candidate
        logits = s if logits is None else ggml.ggml_concat(c, logits, s, 0)
    probs = ggml.ggml_soft_max(c, logits)  # [n_candidates, T]
    row = probs.contents.nb[1]
    mix = None
    for j, v in enumerate(values):
        pj = ggml.ggml_view_2d(c, probs, 1, g.n_tokens, row, j * ggml.ggml_element_size(probs))
        term = ggml.ggml_mul(c, v, pj)
        mix = term if mix is None else ggml.ggml_add(c, mix, term)
    return mix
