"""Gated NoPE MLA in the absorbed form over a latent cache (docs/reference/forward.md, MLA and llama.cpp's graph).

Layout (ggml `ne` order): x [n_embd, T] over every token of the micro-batch; per token the cache row is the normed
latent c [kv_lora] followed by the raw k_pe [rope] (no norm, no rotation: K3 is NoPE, its
"rope" dims are plain learned dims). Each head's query is absorbed into the latent space,
q_lat_h = W_kb[h]^T q_nope_h, so that score_h = q_lat_h . c + q_pe_h . k_pe is one dot product
of [q_lat_h | q_pe_h] with the cache row; the value is the latent itself (a view of the first
kv_lora values of the row) and the output leaves the latent space through attn_v_b.

Two attention kernels share everything else:
* exact (`g.exact`): F32 cache, `mul_mat` + `soft_max_ext` with an F32 mask, no f16 anywhere;
* fast: `flash_attn_ext` with K/V of the cache's type (F16 by default; F32, BF16, Q8_0) and an
  F16 mask, as llama.cpp runs it;
the gathered DSA path (attend_gathered) uses matmul + softmax on both, over the rows in the
cache's type (F16 for Q8_0). A run's attention goes through its queries in spans (span_tokens).
"""
from __future__ import annotations

import ggml
import numpy as np

from gguf_arch.arch.config import K3Config
from gguf_arch.arch.tensors import (ATTN_GATE, ATTN_KV_A_MQA, ATTN_KV_A_NORM, ATTN_K_B, ATTN_OUTPUT,
                                    ATTN_Q_A, ATTN_Q_A_NORM, ATTN_Q_B, ATTN_V_B)

from . import dsa
from ..graph.build import F32, GraphBuild, Tensor
from ..graph.ubatch import SeqRun, Span, spans
from ..weights.loader import LayerWeights

_F16 = ggml.GGML_TYPE_F16

# The gathered DSA path copies T * k cache rows; queries go through in groups of at most this
# many bytes of them (see attend_gathered).
GATHER_CHUNK_BYTES = 64 << 20
# A run's attention goes through its queries in spans (span_tokens): no tensor of a span that
# grows with the cache and the tokens (the indexer's q.k, scores, masks, the exact path's
# attention scores) holds more than this, or one token's part when that alone is larger. With
# the causal mask of the micro-batch (n_kv x n_ubatch x 4 bytes, as llama.cpp's KQ mask) this is
# the bound docs/long-context.md states.
ATTN_CHUNK_BYTES = 64 << 20


def q_lora_latent(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """cq = rmsnorm(attn_q_a x), [q_lora, T]: the MLA queries and the DSA indexer queries read it."""
    return g.rms_norm(g.mm(w(ATTN_Q_A), x), w(ATTN_Q_A_NORM), g.qk_latent_eps)


def absorbed_query(g: GraphBuild, w: LayerWeights, cq: Tensor) -> Tensor:
    """[q_lat | q_pe] per head, ne [kv_lora + rope, T, H]."""
    c = g.cfg
    ctx, T, H = g.ctx, g.n_tokens, c.num_heads
    q = ggml.ggml_reshape_3d(ctx, g.mm(w(ATTN_Q_B), cq), c.qk_head_dim, H, T)
    f = ggml.ggml_element_size(q)
    q_nope = ggml.ggml_view_3d(ctx, q, c.qk_nope_head_dim, H, T, q.contents.nb[1], q.contents.nb[2], 0)
    q_pe = ggml.ggml_view_3d(ctx, q, c.qk_rope_head_dim, H, T, q.contents.nb[1], q.contents.nb[2],
                             c.qk_nope_head_dim * f)
    # Heads become the batch dim so attn_k_b [nope, kv_lora, H] multiplies each head's query. The
    # permuted view goes in as is, as in llama.cpp: for an F32 weight ggml then takes its
    # non-contiguous matmul path, whose summation order differs from the contiguous one's.
    q_nope = ggml.ggml_permute(ctx, q_nope, 0, 2, 1, 3)  # [nope, T, H]
    q_lat = g.mm(w(ATTN_K_B), q_nope)  # [kv_lora, T, H]
    q_pe = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, q_pe, 0, 2, 1, 3))  # [rope, T, H]
    return ggml.ggml_concat(ctx, q_lat, q_pe, 0)


def latent_row(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """The cache row per token, [rmsnorm(c) | k_pe], ne [kv_lora + rope, T]."""
    c = g.cfg
    ctx, T = g.ctx, g.n_tokens
    kv = g.mm(w(ATTN_KV_A_MQA), x)  # [kv_lora + rope, T]
    f = ggml.ggml_element_size(kv)
    lat = ggml.ggml_view_2d(ctx, kv, c.kv_lora_rank, T, kv.contents.nb[1], 0)
    k_pe = ggml.ggml_view_2d(ctx, kv, c.qk_rope_head_dim, T, kv.contents.nb[1], c.kv_lora_rank * f)
    lat = g.rms_norm(ggml.ggml_cont(ctx, lat), w(ATTN_KV_A_NORM), g.qk_latent_eps)
    return ggml.ggml_concat(ctx, lat, ggml.ggml_cont(ctx, k_pe), 0)


def _value_view(g: GraphBuild, kv: Tensor) -> Tensor:
    """The value is the latent part of each cache row: a view, no copy."""
    return ggml.ggml_view_2d(g.ctx, kv, g.cfg.kv_lora_rank, kv.contents.ne[1], kv.contents.nb[1], 0)


def attend_exact(g: GraphBuild, q: Tensor, kv: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(scale * q.k + mask) v in F32; q [D, T, H], kv [D, n_kv] F32 -> [kv_lora, T, H]."""
    ctx = g.ctx
    kq = ggml.ggml_mul_mat(ctx, kv, q)  # [n_kv, T, H]; kv broadcast over the heads
    p = ggml.ggml_soft_max_ext(ctx, kq, mask, scale, 0.0)
    v_t = ggml.ggml_cont(ctx, ggml.ggml_transpose(ctx, _value_view(g, kv)))  # [n_kv, kv_lora]
    return ggml.ggml_mul_mat(ctx, v_t, p)


def attend_flash(g: GraphBuild, q: Tensor, kv: Tensor, mask: Tensor, scale: float) -> Tensor:
    """llama.cpp's kernel: flash_attn_ext over the F16 cache (K, and V as its view) with an F16
    mask -> [kv_lora, T, H]."""
    ctx = g.ctx
    o = ggml.ggml_flash_attn_ext(ctx, q, kv, _value_view(g, kv), ggml.ggml_cast(ctx, mask, _F16), scale, 0.0, 0.0)
    # A view, not a copy, for attn_v_b's matmul (as in llama.cpp; see absorbed_query).
    return ggml.ggml_permute(ctx, o, 0, 2, 1, 3)  # [kv_lora, H, T] -> [kv_lora, T, H]


def _gathered_rows(g: GraphBuild, kv: Tensor, sel: Tensor) -> Tensor:
    """The cache rows sel [k, T] names, per query: [D, k, T] F32 (get_rows dequantizes F16)."""
    k, T = sel.contents.ne[0], sel.contents.ne[1]
    rows = ggml.ggml_get_rows(g.ctx, kv, ggml.ggml_reshape_1d(g.ctx, sel, k * T))
    return ggml.ggml_reshape_3d(g.ctx, rows, kv.contents.ne[0], k, T)


def gathered_type(kv: Tensor) -> int:
    """The type the gathered rows are multiplied in: the cache's own (F32, F16, BF16: its values
    exactly), F16 for a quantized cache (its dequantized values rounded once, as flash attention
    rounds the queries)."""
    t = kv.contents.type
    return t if t in (F32, _F16, ggml.GGML_TYPE_BF16) else _F16


def _values_t(g: GraphBuild, rows: Tensor, vtype: int) -> Tensor:
    """The latent part of F32 rows [D, k, T], transposed for the value matmul: [k, kv_lora, T].

    In F16 / BF16 one ggml_cpy into a new tensor of that type transposes and rounds in a single
    pass: a third of the time ggml_cont takes to transpose the F16 copy (bench/graph.py, per-op
    profile)."""
    ctx, r = g.ctx, rows.contents
    v = ggml.ggml_view_3d(ctx, rows, g.cfg.kv_lora_rank, r.ne[1], r.ne[2], r.nb[1], r.nb[2], 0)
    v_t = ggml.ggml_permute(ctx, v, 1, 0, 2, 3)  # [k, kv_lora, T], a view
    if vtype == F32:
        return ggml.ggml_cont(ctx, v_t)
    return ggml.ggml_cpy(ctx, v_t, ggml.ggml_new_tensor_3d(ctx, vtype, r.ne[1], g.cfg.kv_lora_rank, r.ne[2]))


def _attend_rows(g: GraphBuild, q: Tensor, rows: Tensor, mask: Tensor, scale: float, vtype: int) -> Tensor:
    """q [D, H, T], rows [D, k, T] F32, mask [k, 1, T] (0 / -inf) -> [kv_lora, H, T]; the
    products in `vtype` (gathered_type).

    Two matmuls and a softmax, on both kernels: each query's H heads share its k rows, so q.k
    is one [k, D] x [D, H] product per query, which ggml's matmul runs blocked (llamafile's
    sgemm), where flash_attn_ext takes the heads one by one with a dot product per key (measured
    on the 7168-wide model, one thread: 0.83 against 1.75 ms at 1k keys / top_k 128, 7.4
    against 11.2 ms at 8k / 1024). In F16 / BF16 (the cache's own values) ggml rounds q and p to
    that type for the products, as flash attention rounds q to its key type.

    The mask is added before the scale: its values are 0 and -inf, which the scale keeps, so
    the softmax sees scale * q.k + mask as soft_max_ext does on the masked path."""
    ctx = g.ctx
    keys = rows if vtype == F32 else ggml.ggml_cast(ctx, rows, vtype)
    kq = ggml.ggml_add(ctx, ggml.ggml_mul_mat(ctx, keys, q), mask)  # [k, H, T]
    p = ggml.ggml_soft_max_ext(ctx, kq, None, scale, 0.0)
    return ggml.ggml_mul_mat(ctx, _values_t(g, rows, vtype), p)


def attend_gathered(g: GraphBuild, q: Tensor, kv: Tensor, mask: Tensor, k: int, scale: float) -> Tensor:
    """Attention of each query over only its k selected cache rows -> [kv_lora, T, H].

    The selection is read back from the DSA mask (0 on the selected visible keys, -inf
    elsewhere) with ggml_top_k; a query that sees fewer than k keys also gets invisible cells,
    whose gathered mask value (-inf) removes them again. The gathered rows take T * k * D * 4
    bytes, so the queries go through in groups of at most GATHER_CHUNK_BYTES of rows (ggml-alloc
    reuses the memory from group to group)."""
    ctx, D = g.ctx, kv.contents.ne[0]
    n_kv, T = mask.contents.ne[0], mask.contents.ne[1]
    sel = ggml.ggml_cont(ctx, ggml.ggml_top_k(ctx, mask, k))  # [k, T]
    sel_mask = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, mask, 1, n_kv, T), sel)  # [1, k, T]
    q = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, q, 0, 2, 1, 3))  # [D, T, H] -> [D, H, T]
    step = max(1, GATHER_CHUNK_BYTES // (k * D * 4))
    vtype = F32 if g.exact else gathered_type(kv)
    out = None
    for t0 in range(0, T, step):
        n = min(step, T - t0)
        rows = _gathered_rows(g, kv, _cols(g, sel, t0, n, 2))
        part = _attend_rows(g, _cols(g, q, t0, n, 3), rows,
                            ggml.ggml_reshape_3d(ctx, _cols(g, sel_mask, t0, n, 3), k, 1, n), scale, vtype)
        out = part if out is None else ggml.ggml_concat(ctx, out, part, 2)
    return ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, out, 0, 2, 1, 3))  # [kv_lora, H, T] -> [kv_lora, T, H]


def _cols(g: GraphBuild, t: Tensor, t0: int, n: int, n_dims: int) -> Tensor:
    """Tokens t0 .. t0+n-1 (the last dimension) of a [a, T] (n_dims 2) or [a, b, T] tensor: a view."""
    c = t.contents
    if n_dims == 3:
        return ggml.ggml_view_3d(g.ctx, t, c.ne[0], c.ne[1], n, c.nb[1], c.nb[2], t0 * c.nb[2])
    return ggml.ggml_view_2d(g.ctx, t, c.ne[0], n, c.nb[1], t0 * c.nb[1])


def span_tokens(cfg: K3Config, exact: bool, run: SeqRun, dsa_on: bool) -> int:
    """Tokens per span of a run's attention: as many as keep every [n_kv x tokens] tensor of a span
    within ATTN_CHUNK_BYTES (at least one token). The widest per token: the indexer's H_I rows of
    q.k (DSA), the exact path's H rows of scores, the F32 scores and masks (4 bytes a key)."""
    width = max(cfg.indexer.n_heads if dsa_on else 1, cfg.num_heads if exact else 1)
    return max(1, min(run.n_tokens, ATTN_CHUNK_BYTES // (4 * width * run.n_kv)))


# Graph nodes of one span's attention at most (DSA scores and selection, attention) and of one
# group of gathered queries: the node budget of a graph (attention_nodes).
NODES_PER_SPAN = 64
NODES_PER_GATHER_GROUP = 16


def attention_nodes(cfg: K3Config, exact: bool, run: SeqRun, top_k: int | None) -> int:
    """The nodes a run's attention may add to a graph per MLA layer (its spans, their gathered
    groups): Model sizes its graphs with it."""
    n = span_tokens(cfg, exact, run, top_k is not None)
    groups = 1
    if top_k is not None:
        groups = -(-n // max(1, GATHER_CHUNK_BYTES // (top_k * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4)))
    return -(-run.n_tokens // n) * (NODES_PER_SPAN + NODES_PER_GATHER_GROUP * groups)


def _run_cols(g: GraphBuild, t: Tensor, run: SeqRun) -> Tensor:
    """The run's columns of a [rows, T] tensor."""
    if run.n_tokens == g.n_tokens:
        return t
    return _cols(g, t, run.offset, run.n_tokens, 2)


def _span_query(g: GraphBuild, q: Tensor, span: Span) -> Tensor:
    """The span's columns of the queries q [D, T, H] of the micro-batch (contiguous)."""
    if span.n == g.n_tokens:
        return q
    c = q.contents
    view = ggml.ggml_view_3d(g.ctx, q, c.ne[0], span.n, c.ne[2], c.nb[1], c.nb[2],
                             (span.run.offset + span.t0) * c.nb[1])
    return ggml.ggml_cont(g.ctx, view)


def _attend_run(g: GraphBuild, w: LayerWeights, q: Tensor, rows: Tensor, dsa_in, run: SeqRun, scale: float) -> Tensor:
    """One run's attention over its own sequence's cache, span by span: [kv_lora, T_run, H]. Each
    run is the graph a single sequence of the same length builds, so its values are that
    sequence's alone."""
    kv = g.store(g.cache.mla_latent(w.layer), _run_cols(g, rows, run), run)  # [kv_lora + rope, n_kv]
    top_k = g.dsa_top_k(w.layer)
    keys = dsa.store_keys(g, w, dsa_in, run) if top_k is not None else None
    records = dsa.DsaRecords(w.layer, [], []) if top_k is not None else None
    out = None
    for span in spans(run, span_tokens(g.cfg, g.exact, run, top_k is not None)):
        part = _attend_span(g, _span_query(g, q, span), kv, (dsa_in, keys, records), span, top_k, scale)
        out = part if out is None else ggml.ggml_concat(g.ctx, out, part, 1)
    if records is not None:
        records.record(g)
    return out


def _attend_span(g: GraphBuild, q: Tensor, kv: Tensor, indexer, span: Span, top_k: int | None,
                 scale: float) -> Tensor:
    """A span's attention: [kv_lora, n, H]. indexer: (IndexerInputs, key cache rows, DsaRecords)."""
    if top_k is None:
        mask = g.kq_mask_of(span)
    else:
        inp, keys, records = indexer
        mask = dsa.build_dsa_mask(g, inp, keys, span, top_k, records)
    if top_k is not None and g.dsa_path == "gather" and top_k < span.n_kv:
        return attend_gathered(g, q, kv, mask, top_k, scale)
    # dense, masked DSA, or a selection that is the whole visible context anyway
    return (attend_exact if g.exact else attend_flash)(g, q, kv, mask, scale)


def build_mla(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """Gated NoPE MLA of layer `w.layer` (DSA-masked when `g.dsa_top_k` says so): [n_embd, T]."""
    c = g.cfg
    ctx, T = g.ctx, g.n_tokens
    if g.wants("attn_input"):  # what the indexer and the projections read (an independent check's input)
        g.record("attn_input", w.layer, x)
    cq = q_lora_latent(g, w, x)
    q = absorbed_query(g, w, cq)
    rows = latent_row(g, w, x)  # [kv_lora + rope, T]
    dsa_in = dsa.indexer_inputs(g, w, x, cq) if g.dsa_top_k(w.layer) is not None else None
    # The full nope + rope head dim, not the absorbed length; 1/sqrt in F32 as llama.cpp computes
    # it (1 ulp off the correctly rounded value for some dims, 24 in the fixtures).
    scale = float(np.float32(1) / np.sqrt(np.float32(c.qk_head_dim)))
    o_lat = None  # [kv_lora, T, H], the runs' outputs in micro-batch order
    for run in g.ubatch.runs:
        part = _attend_run(g, w, q, rows, dsa_in, run, scale)
        o_lat = part if o_lat is None else ggml.ggml_concat(ctx, o_lat, part, 1)
    o = g.mm(w(ATTN_V_B), o_lat)  # [v_dim, T, H]
    o = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, o, 0, 2, 1, 3))  # [v_dim, H, T]
    o = ggml.ggml_reshape_2d(ctx, o, c.v_head_dim * c.num_heads, T)
    o = ggml.ggml_mul(ctx, o, ggml.ggml_sigmoid(ctx, g.mm(w(ATTN_GATE), x)))
    return g.mm(w(ATTN_OUTPUT), o)
