"""The whole model as one graph: embedding, the decoder layers with Block AttnRes, the output
mix, norm and head (docs/reference: forward math). Composes the per-block builders of this package."""
from __future__ import annotations

from functools import partial

import ggml

from gguf_arch.arch.tensors import (ATTN_NORM, ATTN_RES_SCORE, FFN_RES_SCORE, OUTPUT, OUTPUT_NORM,
                                    OUTPUT_RES_SCORE, TOKEN_EMBD)

from ..graph.build import DEQUANT_CHUNK_BYTES, GraphBuild
from ..graph.placement import OUTPUT_SEGMENT
from ..weights.loader import GGUFWeights
from .attn_res import ResidualBank, attn_res
from .ffn import build_dense_ffn, ffn_norm
from .kda import build_kda
from .mla import build_mla
from .moe import build_moe, predict_experts


def build_forward(g: GraphBuild, weights: GGUFWeights, tokens=None, out_ids=None, embedded=None):
    """Embedding -> 93 (or n) decoder layers with Block AttnRes -> output mix, norm, lm_head
    (docs/reference/forward.md, AttnRes and Output head).

    tokens: I32 [T] input; or embedded: the input columns [n_embd, T] already made (token
    embeddings with embedding rows in their places, engine/inputs.py). out_ids: I32 [n], the
    columns whose logits are wanted (None: every column)."""
    cfg, c = g.cfg, g.ctx
    t = weights.tensors
    p = embedded if embedded is not None else ggml.ggml_get_rows(c, t[TOKEN_EMBD], tokens)  # [n_embd, T], F32
    bank = ResidualBank()
    first_moe = cfg.moe_layers[0] if cfg.moe_layers else 0
    for l in range(cfg.num_layers):
        g.begin_segment(l)
        w = weights.layer(l)
        x = p if len(bank) == 0 else attn_res(g, p, bank, w(ATTN_RES_SCORE))
        if l == 0 and first_moe > 0:
            _predict_experts(g, weights, first_moe, x)
        if l % cfg.attn_res_block_size == 0:
            bank.push(g, p)  # bank the raw incoming partial sum; the block restarts
            p = None
        h = g.rms_norm(x, w(ATTN_NORM), cfg.rms_norm_eps)
        a = build_kda(g, w, h) if cfg.is_kda(l) else build_mla(g, w, h)
        p = a if p is None else ggml.ggml_add(c, p, a)
        y = attn_res(g, p, bank, w(FFN_RES_SCORE))
        if l + 1 < cfg.num_layers and cfg.is_moe(l + 1) and l + 1 != first_moe:
            _predict_experts(g, weights, l + 1, y)
        h = ffn_norm(g, w, y)
        f = build_moe(g, w, h) if cfg.is_moe(l) else build_dense_ffn(g, w, h)
        p = ggml.ggml_add(c, p, f)
        if g.wants("hidden"):
            g.record("hidden", l, p)
    g.begin_segment(OUTPUT_SEGMENT)
    out = attn_res(g, p, bank, t[OUTPUT_RES_SCORE])
    if out_ids is not None:  # only these columns' logits (I32 [n]): the head is the largest matmul
        out = ggml.ggml_get_rows(c, out, out_ids)
    out = g.rms_norm(out, t[OUTPUT_NORM], cfg.rms_norm_eps)
    return g.mm(t[OUTPUT], out)  # [vocab, T]


def _predict_experts(g: GraphBuild, weights: GGUFWeights, layer: int, x) -> None:
    """Offer a memory budget's executor MoE layer `layer`'s experts predicted from x (an earlier
    input, before the norm): it reads them while the compute up to that layer's selection runs.
    Every MoE layer is predicted at the FFN input of the layer before, but the token's first: from
    the embedding, ahead of the first layer's attention, since from the previous token's last
    selection until then the disk has nothing to read (at a dense layer 0's FFN input, as first
    done, it also idled through that attention: bench/memory.py's model at 1/2, 21 ms of idle
    disk a token against 16, the prediction as often right)."""
    if g.predict_experts is not None:
        g.predict_experts(g, layer, partial(predict_experts, g, weights.layer(layer), x))


def graph_size(weights: GGUFWeights) -> int:
    """Node budget: generous per layer (AttnRes grows with the bank, MoE with the expert count),
    plus the exact path's dequantization chunks (3 nodes each) of every 2-D weight."""
    cfg = weights.cfg
    n_blocks = cfg.num_layers // cfg.attn_res_block_size + 2
    chunks = sum(-(-4 * ggml.ggml_nelements(t) // DEQUANT_CHUNK_BYTES)
                 for t in weights.tensors.values() if ggml.ggml_n_dims(t) <= 2)
    return 1024 + cfg.num_layers * (256 + 8 * cfg.num_experts_used + 16 * n_blocks) + 3 * chunks
