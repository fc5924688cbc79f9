"""K3.1-Pro DSA: the lightning indexer and its top-k selection as an attention mask
(docs/reference/dsa.md, Indexer math and Caches: NoPE, so no RoPE and no Hadamard rotation).

The MLA attention still runs over the whole latent cache ("masked sparse-flash", as llama.cpp
does): the selection only enters as a 0 / -inf mask added to the causal mask.

Layout (ggml `ne` order): x [n_embd, T], cq [q_lora, T] over every token of the micro-batch;
the scores and the mask [n_kv, T] of each run (one sequence's tokens) over its own cache rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import ggml
import numpy as np

from gguf_arch.arch.tensors import INDEXER_K, INDEXER_K_NORM, INDEXER_K_NORM_BIAS, INDEXER_PROJ, INDEXER_Q_B

from ..graph.build import GraphBuild, Tensor
from ..graph.ubatch import SeqRun
from ..weights.loader import LayerWeights

KEY_NORM_EPS = 1e-6  # the indexer key LayerNorm (DeepSeek-V3.2 default, kept by the contract)

# Invisible (causally masked) cells are clamped to this finite value before the selection so
# that the comparisons below never meet inf - inf = NaN; visible scores are far above it.
_FLOOR = float(np.finfo(np.float32).min)


def indexer_key(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """kI = LayerNorm(indexer.attn_k x; gain k_norm, bias k_norm.bias or 0), ne [D_I, T]."""
    ctx = g.ctx
    k = ggml.ggml_norm(ctx, g.mm(w(INDEXER_K), x), KEY_NORM_EPS)
    k = ggml.ggml_mul(ctx, k, w(INDEXER_K_NORM))
    if w.has(INDEXER_K_NORM_BIAS):
        k = ggml.ggml_add(ctx, k, w(INDEXER_K_NORM_BIAS))
    return k


def head_weights(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """w = (indexer.proj x) * H_I^-0.5 * D_I^-0.5, ne [H_I, T], the two factors applied in the
    order of docs/reference/dsa.md#indexer-math."""
    ix = g.cfg.indexer
    ctx = g.ctx
    hw = g.mm(w(INDEXER_PROJ), x)
    return ggml.ggml_scale(ctx, ggml.ggml_scale(ctx, hw, ix.n_heads ** -0.5), ix.head_dim ** -0.5)


@dataclass(frozen=True)
class IndexerInputs:
    """A DSA layer's indexer tensors for every token of the micro-batch, made once per layer."""

    queries: Tensor  # [D_I, H_I * T]: head h of token t at column h + t H_I
    weights: Tensor  # [H_I * T], same order
    keys: Tensor  # [D_I, T]: the tokens' own keys, not yet in the cache


def indexer_inputs(g: GraphBuild, w: LayerWeights, x: Tensor, cq: Tensor) -> IndexerInputs:
    ix = g.cfg.indexer
    q = ggml.ggml_reshape_2d(g.ctx, g.mm(w(INDEXER_Q_B), cq), ix.head_dim, ix.n_heads * g.n_tokens)
    hw = ggml.ggml_reshape_1d(g.ctx, head_weights(g, w, x), ix.n_heads * g.n_tokens)
    return IndexerInputs(q, hw, indexer_key(g, w, x))


def _run_span(g: GraphBuild, t: Tensor, run: SeqRun, per_token: int) -> Tensor:
    """The run's part of a per-token tensor: `per_token` consecutive rows (2-D) or values (1-D) a token."""
    if run.n_tokens == g.n_tokens:
        return t
    c = t.contents
    if ggml.ggml_n_dims(t) == 1:
        return ggml.ggml_view_1d(g.ctx, t, per_token * run.n_tokens, per_token * run.offset * c.nb[0])
    return ggml.ggml_view_2d(g.ctx, t, c.ne[0], per_token * run.n_tokens, c.nb[1], per_token * run.offset * c.nb[1])


def indexer_scores(g: GraphBuild, w: LayerWeights, inp: IndexerInputs, run: SeqRun) -> Tensor:
    """score[t, s] = sum_h w[t, h] relu(qI[t, h] . kI[s]) + causal mask, ne [n_kv, T] of one run.

    Appends the run's indexer keys to its sequence's indexer key cache first, so every query
    sees its own key and all earlier ones."""
    ix = g.cfg.indexer
    ctx, T, H = g.ctx, run.n_tokens, ix.n_heads
    keys = g.store(g.cache.indexer_keys(w.layer), _run_span(g, inp.keys, run, 1), run)  # [D_I, n_kv]
    # The one [H_I * T, n_kv] tensor is laid out with the heads fastest, so that weighting and
    # summing over the heads work in place and sum_rows reduces it without a transposed copy.
    qk = ggml.ggml_relu_inplace(ctx, ggml.ggml_mul_mat(ctx, _run_span(g, inp.queries, run, H), keys))
    qk = ggml.ggml_mul_inplace(ctx, qk, _run_span(g, inp.weights, run, H))
    score = ggml.ggml_sum_rows(ctx, ggml.ggml_reshape_2d(ctx, qk, H, T * run.n_kv))  # [1, T * n_kv]
    score = ggml.ggml_cont(ctx, ggml.ggml_transpose(ctx, ggml.ggml_reshape_2d(ctx, score, T, run.n_kv)))
    return ggml.ggml_add(ctx, score, g.kq_mask_of(run))  # [n_kv, T]


def top_k_mask(g: GraphBuild, scores: Tensor, k: int) -> Tensor:
    """0 on the k highest scores of each row, -inf elsewhere; ties: the lower position wins.

    ggml's sort ops are not stable (std::sort, std::partial_sort), and exact ties are common
    (a score is exactly 0 whenever every head's q.k <= 0), so the set is built from facts a
    sort cannot get wrong: v = the k-th largest value of the row is the same for every correct
    sort, whatever it does with ties. The selection is then G = {s: score > v} (|G| < k) plus the
    first k - |G| positions of E = {s: score == v}, counted by a cumulative sum over positions.
    Each step is exact in F32: the sign of a difference of two finite floats is exact, and the
    counts are integers below 2^24 (any context up to 16M tokens). Rows with fewer visible keys
    than k have v = _FLOOR and select every visible key (plus invisible ones, which the causal
    mask removes again). NaN scores are outside the contract and are not handled.
    """
    ctx = g.ctx
    n_kv, T = scores.contents.ne[0], scores.contents.ne[1]
    s = ggml.ggml_clamp(ctx, ggml.ggml_cont(ctx, scores), _FLOOR, -_FLOOR)  # clamp works in place
    order = ggml.ggml_argsort(ctx, s, ggml.GGML_SORT_ORDER_DESC)  # [n_kv, T] I32
    kth = ggml.ggml_view_2d(ctx, order, 1, T, order.contents.nb[1], (k - 1) * ggml.ggml_element_size(order))
    v = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, s, 1, n_kv, T), kth)  # [1, 1, T]
    d = ggml.ggml_sub(ctx, s, ggml.ggml_reshape_2d(ctx, v, 1, T))  # score - v
    above = ggml.ggml_step(ctx, d)
    below = ggml.ggml_step(ctx, ggml.ggml_neg(ctx, d))
    tied = ggml.ggml_scale_bias(ctx, ggml.ggml_add(ctx, above, below), -1.0, 1.0)  # 1 - above - below
    room = ggml.ggml_scale_bias(ctx, ggml.ggml_sum_rows(ctx, above), -1.0, float(k))  # k - |G|, [1, T]
    rank = ggml.ggml_sub(ctx, ggml.ggml_cumsum(ctx, tied), room)  # <= 0 for the first `room` ties
    tie_kept = ggml.ggml_mul(ctx, tied, ggml.ggml_step(ctx, ggml.ggml_scale_bias(ctx, rank, -1.0, 0.5)))
    return ggml.ggml_log(ctx, ggml.ggml_add(ctx, above, tie_kept))  # log(1) = 0, log(0) = -inf


def selection_mask(g: GraphBuild, scores: Tensor, top_k: int, run: SeqRun | None = None) -> Tensor:
    """The attention mask of a DSA layer for one run, [n_kv, T] F32: 0 where key s is among the
    min(top_k, visible) selected keys of query t and visible to it, -inf elsewhere.

    k = min(top_k, n_kv) per row, as llama.cpp: a row seeing fewer than k keys selects all of
    them plus invisible cells, which adding the causal mask removes again. run None: the
    graph's only run."""
    run = run if run is not None else g.ubatch.runs[0]
    return ggml.ggml_add(g.ctx, top_k_mask(g, scores, min(top_k, run.n_kv)), g.kq_mask_of(run))


def build_dsa_mask(g: GraphBuild, w: LayerWeights, inp: IndexerInputs, run: SeqRun, top_k: int) -> Tensor:
    """Indexer scores -> selection mask of layer `w.layer` for one run; records the scores and
    the selected positions when the caller asked for them (a micro-batch of one run)."""
    scores = indexer_scores(g, w, inp, run)
    mask = selection_mask(g, scores, top_k, run)
    if g.wants("index_scores"):
        g.record("index_scores", w.layer, scores)
    if g.wants("index_selected"):
        g.record("index_selected", w.layer, selected_positions(g, mask, min(top_k, run.n_kv)))
    return mask


def selected_positions(g: GraphBuild, mask: Tensor, k: int) -> Tensor:
    """The k cells with the highest mask value per row, I32 [k, T], any order: every visible
    selected cell (0) first; rows with fewer than k of them are filled with invisible cells."""
    ctx = g.ctx
    return ggml.ggml_cont(ctx, ggml.ggml_argsort_top_k(ctx, mask, k))
