"""K3.1-Pro DSA: the lightning indexer and its top-k selection as an attention mask
(docs/reference/dsa.md, Indexer math and Caches: NoPE, so no RoPE and no Hadamard rotation).

The selection is a 0 / -inf mask over the run's cache rows, added to the causal mask; the masked
path runs attention over the whole latent cache with it (as llama.cpp does), the gathered path
reads the selected rows back from it (mla.attend_gathered).

Layout (ggml `ne` order): x [n_embd, T], cq [q_lora, T] over every token of the micro-batch; the
scores and the mask [n_kv, n] of a span (n consecutive tokens of one run, graph/ubatch.py) over
its sequence's cache rows. A run's attention goes span by span (mla.py), so the indexer's
[H_I x n, n_kv] product, the largest tensor here, stays within the span bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import ggml
import numpy as np

from gguf_arch.arch.tensors import INDEXER_K, INDEXER_K_NORM, INDEXER_K_NORM_BIAS, INDEXER_PROJ, INDEXER_Q_B

from ..graph.build import F32, GraphBuild, Tensor
from ..graph.ubatch import SeqRun, Span
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


def _token_span(g: GraphBuild, t: Tensor, offset: int, n: int, per_token: int) -> Tensor:
    """Tokens offset .. offset+n-1 of a per-token tensor: `per_token` consecutive columns (2-D) or
    values (1-D) a token, as a view."""
    if n == g.n_tokens:
        return t
    c = t.contents
    if ggml.ggml_n_dims(t) == 1:
        return ggml.ggml_view_1d(g.ctx, t, per_token * n, per_token * offset * c.nb[0])
    return ggml.ggml_view_2d(g.ctx, t, c.ne[0], per_token * n, c.nb[1], per_token * offset * c.nb[1])


def store_keys(g: GraphBuild, w: LayerWeights, inp: IndexerInputs, run: SeqRun) -> Tensor:
    """Append the run's indexer keys to its sequence's key cache (before any of its queries is
    scored, so each query sees its own key and all earlier ones): the cache's rows [D_I, n_kv]."""
    return g.store(g.cache.indexer_keys(w.layer), _token_span(g, inp.keys, run.offset, run.n_tokens, 1), run)


def indexer_scores(g: GraphBuild, inp: IndexerInputs, keys: Tensor, span: Span) -> Tensor:
    """score[t, s] = sum_h w[t, h] relu(qI[t, h] . kI[s]) + causal mask, ne [n_kv, n] of one span.

    The product runs in the key cache's type: the queries are rounded to it (F16 / BF16) and ggml
    multiplies the cached rows as they are, accumulating in F32. The sum over the heads is a
    second matmul, of relu(q.k) seen as [H_I, n_kv] per token with that token's head weights: it
    reads the [H_I x n, n_kv] product once, where a multiply and a sum over rows read it twice and
    the result would still need a transposed copy (bench/long_context.py, per op)."""
    ctx, H, n, n_kv = g.ctx, g.cfg.indexer.n_heads, span.n, span.n_kv
    q = _token_span(g, inp.queries, span.run.offset + span.t0, n, H)
    if keys.contents.type != F32:
        q = ggml.ggml_cast(ctx, q, keys.contents.type)
    qk = ggml.ggml_relu_inplace(ctx, ggml.ggml_mul_mat(ctx, q, keys))  # [H * n, n_kv], heads fastest
    per_token = ggml.ggml_view_3d(ctx, qk, H, n_kv, n, qk.contents.nb[1], H * qk.contents.nb[0], 0)
    hw = ggml.ggml_reshape_3d(ctx, _token_span(g, inp.weights, span.run.offset + span.t0, n, H), H, 1, n)
    score = ggml.ggml_reshape_2d(ctx, ggml.ggml_mul_mat(ctx, per_token, hw), n_kv, n)  # [n_kv, 1, n]
    return ggml.ggml_add(ctx, score, g.kq_mask_of(span))


def kth_largest(g: GraphBuild, s: Tensor, k: int) -> Tensor:
    """The k-th largest value of each row of s [n_kv, n] (finite), [1, n]: the smallest of the k
    values ggml_top_k finds (a partial sort, O(n_kv log k), where a full argsort is O(n_kv log n_kv)).
    Any correct partial sort gives this value, whatever it does with ties."""
    ctx = g.ctx
    n_kv, n = s.contents.ne[0], s.contents.ne[1]
    top = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, s, 1, n_kv, n), ggml.ggml_top_k(ctx, s, k))  # [1, k, n]
    top = ggml.ggml_reshape_2d(ctx, top, k, n)
    smallest = ggml.ggml_argmax(ctx, ggml.ggml_neg(ctx, top))  # [n]
    v = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, top, 1, k, n), ggml.ggml_reshape_2d(ctx, smallest, 1, n))
    return ggml.ggml_reshape_2d(ctx, v, 1, n)


def top_k_mask(g: GraphBuild, scores: Tensor, k: int) -> Tensor:
    """0 on the k highest scores of each row, -inf elsewhere; ties: the lower position wins.

    ggml's sort ops are not stable (std::partial_sort), and exact ties are common (a score is
    exactly 0 whenever every head's q.k <= 0), so the set is built from facts a sort cannot get
    wrong: v = the k-th largest value of the row is the same for every correct sort, whatever it
    does with ties. The selection is then G = {s: score > v} (|G| < k) plus the first k - |G|
    positions of E = {s: score == v}, counted by a cumulative sum over positions. Each step is
    exact in F32: the sign of a difference of two finite floats is exact, and the counts are
    integers below 2^24 (any context up to 16M tokens). Rows with fewer visible keys than k have
    v = _FLOOR and select every visible key (plus invisible ones, which the causal mask removes
    again). NaN scores are outside the contract and are not handled.
    """
    ctx = g.ctx
    if not ggml.ggml_is_contiguous(scores):
        scores = ggml.ggml_cont(ctx, scores)
    s = ggml.ggml_clamp(ctx, scores, _FLOOR, -_FLOOR)  # in place: `scores` is clamped too
    d = ggml.ggml_sub(ctx, s, kth_largest(g, s, k))  # score - v
    above = ggml.ggml_step(ctx, d)
    tied = ggml.ggml_scale_bias(ctx, ggml.ggml_step(ctx, ggml.ggml_abs(ctx, d)), -1.0, 1.0)  # 1 - (d != 0)
    room = ggml.ggml_scale_bias(ctx, ggml.ggml_sum_rows(ctx, above), -1.0, float(k))  # k - |G|, [1, n]
    rank = ggml.ggml_sub(ctx, ggml.ggml_cumsum(ctx, tied), room)  # <= 0 for the first `room` ties
    tie_kept = ggml.ggml_mul(ctx, tied, ggml.ggml_step(ctx, ggml.ggml_scale_bias(ctx, rank, -1.0, 0.5)))
    return ggml.ggml_log(ctx, ggml.ggml_add(ctx, above, tie_kept))  # log(1) = 0, log(0) = -inf


def selection_mask(g: GraphBuild, scores: Tensor, top_k: int, span: Span | SeqRun | None = None) -> Tensor:
    """The attention mask of a DSA layer for one span, [n_kv, n] F32: 0 where key s is among the
    min(top_k, visible) selected keys of query t and visible to it, -inf elsewhere.

    k = min(top_k, n_kv) per row, as llama.cpp: a row seeing fewer than k keys selects all of
    them plus invisible cells, which adding the causal mask removes again. A run: all its
    tokens; None: the graph's only run."""
    span = span if span is not None else g.ubatch.runs[0]
    span = Span.whole(span) if isinstance(span, SeqRun) else span
    return ggml.ggml_add(g.ctx, top_k_mask(g, scores, min(top_k, span.n_kv)), g.kq_mask_of(span))


@dataclass
class DsaRecords:
    """The scores and selected positions of a layer's spans, recorded once all are built (when the
    caller asked for them: a micro-batch of one run)."""

    layer: int
    scores: list[Tensor]
    selected: list[Tensor]

    def add(self, g: GraphBuild, scores: Tensor, mask: Tensor, k: int) -> None:
        if g.wants("index_scores"):
            self.scores.append(scores)
        if g.wants("index_selected"):
            self.selected.append(selected_positions(g, mask, k))

    def record(self, g: GraphBuild) -> None:
        for what, parts in (("index_scores", self.scores), ("index_selected", self.selected)):
            if parts:
                t = parts[0]
                for p in parts[1:]:
                    t = ggml.ggml_concat(g.ctx, t, p, 1)
                g.record(what, self.layer, t)


def build_dsa_mask(g: GraphBuild, inp: IndexerInputs, keys: Tensor, span: Span, top_k: int,
                   records: DsaRecords | None = None) -> Tensor:
    """Indexer scores -> selection mask of one span; the scores and selected positions go to
    `records` when given."""
    scores = indexer_scores(g, inp, keys, span)
    recorded = records is not None and g.wants("index_scores")
    mask = selection_mask(g, ggml.ggml_cont(g.ctx, scores) if recorded else scores, top_k, span)  # (clamped in place)
    if records is not None:
        records.add(g, scores, mask, min(top_k, span.n_kv))
    return mask


def selected_positions(g: GraphBuild, mask: Tensor, k: int) -> Tensor:
    """The k cells with the highest mask value per row, I32 [k, n], any order: every visible
    selected cell (0) first; rows with fewer than k of them are filled with invisible cells."""
    ctx = g.ctx
    return ggml.ggml_cont(ctx, ggml.ggml_argsort_top_k(ctx, mask, k))
