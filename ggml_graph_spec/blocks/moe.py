"""LatentMoE (docs/reference/forward.md#latentmoe): a sigmoid router on the full width, routed SiTU
experts in the latent space (MXFP4, or dequantized to F32 on the exact path), and the shared experts
on the full width.

Layout (ggml `ne` order, one sequence): x [n_embd, T]; latent z [L, T]; per selected expert
[L, k, T]; expert ids I32 [k, T].
"""
from __future__ import annotations

import ggml
import numpy as np

from gguf_arch.arch.tensors import (EXP_PROBS_B, FFN_DOWN_EXPS, FFN_DOWN_SHEXP, FFN_GATE_EXPS, FFN_GATE_INP,
                                    FFN_GATE_SHEXP, FFN_ROUTED_DOWN, FFN_ROUTED_NORM, FFN_ROUTED_UP,
                                    FFN_UP_EXPS, FFN_UP_SHEXP, layer_name)

from ..graph import taps
from ..graph.build import I32, GraphBuild, Tensor
from ..weights.loader import LayerWeights
from .ffn import ffn_norm, situ, situ_mlp


def _router_logits(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """ffn_gate_inp x, [E, T].

    The exact path multiplies the other way round, (x^T W)^T: ggml picks its F32 kernel by the
    first operand's row count (llamafile's sgemm takes multiples of 4, other counts go to
    ggml's dot products), so with the weight first a score could move by an ulp when pruning
    changes the expert count; with x first each score is the same dot product for any count of
    2 or more, and pruning experts no token selects leaves the exact path's logits bit for bit.
    The fast path keeps llama.cpp's order.
    """
    c, gate = g.ctx, w(FFN_GATE_INP)
    if not g.exact:
        return g.mm(gate, x)
    if g.wants(taps.IMATRIX):
        taps.record_input_sq(g, gate, x)
    return ggml.ggml_cont(c, ggml.ggml_transpose(c, ggml.ggml_mul_mat(c, x, gate)))


def _scores(g: GraphBuild, w: LayerWeights, x: Tensor) -> tuple[Tensor, Tensor]:
    """The router's scores (sigmoid, [E, T]) and the biased scores that pick the experts."""
    probs = ggml.ggml_sigmoid(g.ctx, _router_logits(g, w, x))
    return probs, ggml.ggml_add(g.ctx, probs, w(EXP_PROBS_B))


def _select(g: GraphBuild, w: LayerWeights, x: Tensor) -> tuple[Tensor, Tensor]:
    """The router's scores (sigmoid, [E, T]) and the experts the biased scores pick (I32 [k, T])."""
    probs, biased = _scores(g, w, x)
    return probs, ggml.ggml_cont(g.ctx, ggml.ggml_top_k(g.ctx, biased, g.cfg.num_experts_used))


def predict_experts(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """Layer w's router applied to another layer's FFN input x ([n_embd, T], before the norm):
    the experts w's layer would select for x, I32 [k, T], the likeliest first (ggml_top_k's ids
    come in no order: a full descending argsort, cut to k). A memory budget's executor reads them
    early, the likeliest first (backends/streaming/executor.py); the ids the layer uses are always its own
    router's."""
    c = g.ctx
    order = ggml.ggml_argsort(c, _scores(g, w, ffn_norm(g, w, x))[1], ggml.GGML_SORT_ORDER_DESC)  # [E, T]
    k = g.cfg.num_experts_used
    return ggml.ggml_cont(c, ggml.ggml_view_2d(c, order, k, g.n_tokens, order.contents.nb[1], 0))


def _route(g: GraphBuild, w: LayerWeights, x: Tensor) -> tuple[Tensor, Tensor]:
    """Sigmoid router on the full width; the bias picks the experts, the unbiased scores weigh them.

    Returns (ids I32 [k, T], weights [1, k, T]).
    """
    c, cfg, T = g.ctx, g.cfg, g.n_tokens
    E, k = cfg.num_experts, cfg.num_experts_used
    probs, ids = _select(g, w, x)
    weights = ggml.ggml_get_rows(c, ggml.ggml_reshape_3d(c, probs, 1, E, T), ids)  # [1, k, T]
    if cfg.moe_renormalize:
        total = ggml.ggml_sum_rows(c, ggml.ggml_reshape_2d(c, weights, k, T))  # [1, T]
        weights = ggml.ggml_div(c, weights, ggml.ggml_reshape_3d(c, total, 1, 1, T))
    if g.wants("moe"):
        g.record("moe_experts", w.layer, ids)
        g.record("moe_weights", w.layer, weights)
    return ids, ggml.ggml_scale(c, weights, cfg.routed_scaling_factor)


def _dequantized_experts(g: GraphBuild, experts: Tensor, ids: Tensor) -> Tensor:
    """The experts `ids` selects, dequantized to F32: [in, out, k*T], slot t*k + j.

    One row of the [in*out, n_expert] view is one whole expert (in is a multiple of the MXFP4
    block), so get_rows hands back exactly the selected experts as F32.
    """
    c = g.ctx
    n_in, n_out, n_expert = experts.contents.ne[0], experts.contents.ne[1], experts.contents.ne[2]
    n_slots = g.cfg.num_experts_used * g.n_tokens
    flat = ggml.ggml_reshape_2d(c, experts, n_in * n_out, n_expert)
    picked = ggml.ggml_get_rows(c, flat, ggml.ggml_reshape_1d(c, ids, n_slots))
    return ggml.ggml_reshape_3d(c, picked, n_in, n_out, n_slots)


def _routed_experts(g: GraphBuild, w: LayerWeights, z: Tensor, ids: Tensor) -> Tensor:
    """SiTU experts in the latent space: z [L, T] -> per selected expert [L, k, T].

    Fast path: ggml_mul_mat_id on the MXFP4 tensors (ggml quantizes the activations to 8 bits
    first: ~1% per layer, docs/reference/findings.md). Exact path: the same mul_mat_id over the selected
    experts dequantized to F32, so the activations stay F32.
    """
    c, k, T = g.ctx, g.cfg.num_experts_used, g.n_tokens
    names = (FFN_GATE_EXPS, FFN_UP_EXPS, FFN_DOWN_EXPS)
    routed_ids, stacks = ids, [w(n) for n in names]
    if g.bind_experts is not None:  # a memory budget's executor places the experts (backends/streaming/executor.py)
        ids, stacks = g.bind_experts(g, w.layer, ids, stacks)
        if ids is not routed_ids and not g.exact and not g.wants(taps.IMATRIX):
            return _routed_experts_by_slot(g, z, ids, stacks)
    if g.exact:
        gate_b, up_b, down_b = (_dequantized_experts(g, s, ids) for s in stacks)
        ids = g.input("expert_slots", I32, (k, T), np.arange(k * T, dtype=np.int32).reshape(T, k))
    else:
        gate_b, up_b, down_b = stacks
    z3 = ggml.ggml_reshape_3d(c, z, z.contents.ne[0], 1, T)
    gate = ggml.ggml_mul_mat_id(c, gate_b, z3, ids)  # [I, k, T]
    up = ggml.ggml_mul_mat_id(c, up_b, z3, ids)
    hidden = situ(g, gate, up)
    if g.wants(taps.IMATRIX):
        for name, x in zip(names, (z3, z3, hidden)):
            taps.record_expert_input_sq(g, layer_name(name, w.layer), x, routed_ids, g.cfg.num_experts)
    return ggml.ggml_mul_mat_id(c, down_b, hidden, ids)  # [L, k, T]


def _routed_experts_by_slot(g: GraphBuild, z: Tensor, ids: Tensor, stacks: list[Tensor]) -> Tensor:
    """_routed_experts' fast path one slot (j-th selected expert of every token) at a time, each
    slot's nodes together, their outputs joined: [L, k, T]. For an executor that reads experts
    while the slots whose experts it holds compute (backends/streaming/executor.py). The values are the
    batched matmuls': mul_mat_id computes each (expert, token) row on its own."""
    c, k, T = g.ctx, g.cfg.num_experts_used, g.n_tokens
    z3 = ggml.ggml_reshape_3d(c, z, z.contents.ne[0], 1, T)
    out = None
    for j in range(k):
        slot = ggml.ggml_view_2d(c, ids, 1, T, ids.contents.nb[1], j * ids.contents.nb[0])  # I32 [1, T]
        hidden = situ(g, ggml.ggml_mul_mat_id(c, stacks[0], z3, slot), ggml.ggml_mul_mat_id(c, stacks[1], z3, slot))
        y = ggml.ggml_mul_mat_id(c, stacks[2], hidden, slot)  # [L, 1, T]
        out = y if out is None else ggml.ggml_concat(c, out, y, 1)
    return out


def build_moe(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """LatentMoE on the normed input x [n_embd, T] (docs/reference/forward.md#latentmoe)."""
    c, cfg, T = g.ctx, g.cfg, g.n_tokens
    ids, weights = _route(g, w, x)
    # Made (so computed) after the router and before the routed experts: a memory budget's
    # executor computes these while the selected experts it misses are read (backends/streaming/executor.py)
    z = g.mm(w(FFN_ROUTED_DOWN), x)  # [L, T]
    shared = situ_mlp(g, x, w(FFN_GATE_SHEXP), w(FFN_UP_SHEXP), w(FFN_DOWN_SHEXP))
    outputs = _routed_experts(g, w, z, ids)  # [L, k, T]
    if g.wants(taps.MOE_NORMS):
        taps.record_slot_norms(g, w.layer, outputs)
    per_expert = ggml.ggml_mul(c, outputs, weights)
    L, nb1, nb2 = cfg.latent_size, per_expert.contents.nb[1], per_expert.contents.nb[2]
    u = None
    for j in range(cfg.num_experts_used):
        term = ggml.ggml_view_2d(c, per_expert, L, T, nb2, j * nb1)
        u = term if u is None else ggml.ggml_add(c, u, term)
    routed = g.mm(w(FFN_ROUTED_UP), g.rms_norm(u, w(FFN_ROUTED_NORM), cfg.rms_norm_eps))
    return ggml.ggml_add(c, routed, shared)
