"""One builder per Kimi K3 block except MLA/DSA (mla.py, dsa.py), side by side with k3-spec D.

Activations are F32 with ne = [width, n_tokens] (one sequence). Each builder takes the
`GraphBuild` `g` and, for per-layer blocks, the layer's weights `w` (loader.LayerWeights).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ggml
import numpy as np

from . import taps
from .graph import I32, GraphBuild

# fla's q/k pre-processing in chunk_kda / fused_recurrent_kda: x / sqrt(sum(x^2) + 1e-6)
# (fixture README; the q/k L2-norm eps is one of the traps the fixture discriminates).
KDA_L2_EPS = 1e-6


# ---- D.1 RMSNorm, D.5 SiTU ---------------------------------------------------------------------

def situ(g: GraphBuild, gate, up):
    """[b1*tanh(gate/b1)*sigmoid(gate)] * [b2*tanh(up/b2)], in F32 (D.5)."""
    c, b1, b2 = g.ctx, g.cfg.situ_beta, g.cfg.situ_linear_beta
    capped_gate = ggml.ggml_scale(c, ggml.ggml_tanh(c, ggml.ggml_scale(c, gate, 1.0 / b1)), b1)
    capped_up = ggml.ggml_scale(c, ggml.ggml_tanh(c, ggml.ggml_scale(c, up, 1.0 / b2)), b2)
    return ggml.ggml_mul(c, ggml.ggml_mul(c, capped_gate, ggml.ggml_sigmoid(c, gate)), capped_up)


def situ_mlp(g: GraphBuild, x, w_gate, w_up, w_down):
    """W_down(situ(W_gate x, W_up x)): the dense layer-0 FFN and the shared experts (D.5, D.7)."""
    return g.mm(w_down, situ(g, g.mm(w_gate, x), g.mm(w_up, x)))


# ---- D.2 KDA ----------------------------------------------------------------------------------

def _l2_norm_heads(g: GraphBuild, x, head_dim: int):
    """x / sqrt(sum(x^2) + 1e-6) per head, as rms_norm(x, eps/d) / sqrt(d) (same value exactly)."""
    return ggml.ggml_scale(g.ctx, ggml.ggml_rms_norm(g.ctx, x, KDA_L2_EPS / head_dim), head_dim ** -0.5)


def _short_conv(g: GraphBuild, w, which: str, u):
    """Depthwise causal conv (kernel K, no bias) over [cached K-1 inputs | u], then SiLU.

    u: [P, T]. The conv state keeps the last K-1 inputs for the next call.
    """
    c, kda, T = g.ctx, g.cfg.kda, g.n_tokens
    P, K = kda.proj_dim, kda.conv_kernel
    state = g.cache.kda_conv(w.layer, which)
    sx = ggml.ggml_concat(c, state, ggml.ggml_cont(c, ggml.ggml_transpose(c, u)), 0)  # [K-1+T, P]
    kernel = ggml.ggml_reshape_2d(c, w(f"ssm_conv1d_{which}.weight"), K, P)
    y = ggml.ggml_ssm_conv(c, ggml.ggml_reshape_3d(c, sx, K - 1 + T, P, 1), kernel)  # [P, T, 1]
    elem = ggml.ggml_element_size(sx)
    g.overwrite(state, ggml.ggml_view_2d(c, sx, K - 1, P, sx.contents.nb[1], T * elem))
    return ggml.ggml_silu(c, ggml.ggml_reshape_2d(c, y, P, T))


def _kda_gate(g: GraphBuild, w, x):
    """Log-decay g = lb * sigmoid(exp(A_h) * (f_b(f_a(x)) + dt_bias)), per head and channel.

    The GGUF stores ssm_a = -exp(A_log[:H]) (one value per head), so exp(A_h) = -ssm_a.
    """
    c, kda, T = g.ctx, g.cfg.kda, g.n_tokens
    S, H = kda.head_dim, kda.num_heads
    s = g.mm(w("ssm_f_b.weight"), g.mm(w("ssm_f_a.weight"), x))
    s = ggml.ggml_add(c, ggml.ggml_reshape_3d(c, s, S, H, T), ggml.ggml_reshape_2d(c, w("ssm_dt.bias"), S, H))
    exp_a = ggml.ggml_neg(c, ggml.ggml_reshape_2d(c, w("ssm_a"), 1, H))
    return ggml.ggml_scale(c, ggml.ggml_sigmoid(c, ggml.ggml_mul(c, s, exp_a)), kda.gate_lower_bound)


def build_kda(g: GraphBuild, w, x):
    """Kimi Delta Attention on the normed input x [n_embd, T] -> [n_embd, T] (D.2)."""
    c, kda, T = g.ctx, g.cfg.kda, g.n_tokens
    S, H, P = kda.head_dim, kda.num_heads, kda.proj_dim
    q, k, v = (ggml.ggml_reshape_3d(c, _short_conv(g, w, name, g.mm(w(f"attn_{name}.weight"), x)), S, H, T)
               for name in ("q", "k", "v"))
    q, k = _l2_norm_heads(g, q, S), _l2_norm_heads(g, k, S)
    beta = ggml.ggml_reshape_4d(c, ggml.ggml_sigmoid(c, g.mm(w("ssm_beta.weight"), x)), 1, H, T, 1)
    gate = _kda_gate(g, w, x)
    state = g.cache.kda_state(w.layer)
    # The op scales q by 1/sqrt(S) itself (findings.md) and returns [outputs | final state].
    out = ggml.ggml_gated_delta_net(c, q, k, v, gate, beta, ggml.ggml_reshape_4d(c, state, S, S, H, 1), 1)
    elem = ggml.ggml_element_size(out)
    o = ggml.ggml_view_3d(c, out, S, H, T, S * elem, S * H * elem, 0)
    g.overwrite(state, ggml.ggml_view_1d(c, out, S * S * H, S * H * T * elem))
    # Gated output norm: rmsnorm over head_dim (weight shared by heads) times sigmoid(g_proj x).
    gate_out = ggml.ggml_reshape_3d(c, g.mm(w("ssm_g.weight"), x), S, H, T)
    o = ggml.ggml_mul(c, g.rms_norm(o, w("ssm_norm.weight"), g.cfg.rms_norm_eps), ggml.ggml_sigmoid(c, gate_out))
    return g.mm(w("attn_output.weight"), ggml.ggml_reshape_2d(c, o, P, T))


# ---- D.4 Attention Residuals ------------------------------------------------------------------

@dataclass
class ResidualBank:
    """The banked block residuals of one forward pass: raw values and their RMS-normed keys."""

    values: list = field(default_factory=list)
    keys: list = field(default_factory=list)

    def push(self, g: GraphBuild, p) -> None:
        self.values.append(p)
        self.keys.append(ggml.ggml_rms_norm(g.ctx, p, g.cfg.rms_norm_eps))

    def __len__(self) -> int:
        return len(self.values)


def attn_res(g: GraphBuild, p, bank: ResidualBank, score):
    """Softmax over [bank..., P] of (rmsnorm(V_j) . score), mixing the RAW values V_j (D.4).

    `score` is the fused f32 vector norm_gain * pseudo_query ([n_embd]).
    """
    c = g.ctx
    values = bank.values + [p]
    keys = bank.keys + [ggml.ggml_rms_norm(c, p, g.cfg.rms_norm_eps)]
    logits = ggml.ggml_mul_mat(c, score, keys[0])  # [1, T] per candidate
    for key in keys[1:]:
        logits = ggml.ggml_concat(c, logits, ggml.ggml_mul_mat(c, score, key), 0)
    probs = ggml.ggml_soft_max(c, logits)  # [n_candidates, T]
    row = probs.contents.nb[1]
    mix = None
    for j, v in enumerate(values):
        pj = ggml.ggml_view_2d(c, probs, 1, g.n_tokens, row, j * ggml.ggml_element_size(probs))
        term = ggml.ggml_mul(c, v, pj)
        mix = term if mix is None else ggml.ggml_add(c, mix, term)
    return mix


# ---- D.6 LatentMoE ----------------------------------------------------------------------------

def _router_logits(g: GraphBuild, w, x):
    """ffn_gate_inp x, [E, T].

    The exact path multiplies the other way round, (x^T W)^T: ggml picks its F32 kernel by the
    first operand's row count (llamafile's sgemm takes multiples of 4, other counts go to
    ggml's dot products), so with the weight first a score could move by an ulp when pruning
    changes the expert count; with x first each score is the same dot product for any count of
    2 or more, and pruning experts no token selects leaves the exact path's logits bit for bit.
    The fast path keeps llama.cpp's order.
    """
    c, gate = g.ctx, w("ffn_gate_inp.weight")
    if not g.exact:
        return g.mm(gate, x)
    if g.wants(taps.IMATRIX):
        taps.record_input_sq(g, gate, x)
    return ggml.ggml_cont(c, ggml.ggml_transpose(c, ggml.ggml_mul_mat(c, x, gate)))


def _route(g: GraphBuild, w, x):
    """Sigmoid router on the full width; the bias picks the experts, the unbiased scores weigh them.

    Returns (ids I32 [k, T], weights [1, k, T]).
    """
    c, cfg, T = g.ctx, g.cfg, g.n_tokens
    E, k = cfg.num_experts, cfg.num_experts_used
    probs = ggml.ggml_sigmoid(c, _router_logits(g, w, x))  # [E, T]
    ids = ggml.ggml_cont(c, ggml.ggml_top_k(c, ggml.ggml_add(c, probs, w("exp_probs_b.bias")), k))
    weights = ggml.ggml_get_rows(c, ggml.ggml_reshape_3d(c, probs, 1, E, T), ids)  # [1, k, T]
    if cfg.moe_renormalize:
        total = ggml.ggml_sum_rows(c, ggml.ggml_reshape_2d(c, weights, k, T))  # [1, T]
        weights = ggml.ggml_div(c, weights, ggml.ggml_reshape_3d(c, total, 1, 1, T))
    if g.wants("moe"):
        g.record("moe_experts", w.layer, ids)
        g.record("moe_weights", w.layer, weights)
    return ids, ggml.ggml_scale(c, weights, cfg.routed_scaling_factor)


def _dequantized_experts(g: GraphBuild, experts, ids):
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


def _routed_experts(g: GraphBuild, w, z, ids):
    """SiTU experts in the latent space: z [L, T] -> per selected expert [L, k, T].

    Fast path: ggml_mul_mat_id on the MXFP4 tensors (ggml quantizes the activations to 8 bits
    first: ~1% per layer, findings.md). Exact path: the same mul_mat_id over the selected
    experts dequantized to F32, so the activations stay F32.
    """
    c, k, T = g.ctx, g.cfg.num_experts_used, g.n_tokens
    names = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
    routed_ids = ids
    if g.exact:
        gate_b, up_b, down_b = (_dequantized_experts(g, w(n), ids) for n in names)
        ids = g.input("expert_slots", I32, (k, T), np.arange(k * T, dtype=np.int32).reshape(T, k))
    else:
        gate_b, up_b, down_b = (w(n) for n in names)
    z3 = ggml.ggml_reshape_3d(c, z, z.contents.ne[0], 1, T)
    gate = ggml.ggml_mul_mat_id(c, gate_b, z3, ids)  # [I, k, T]
    up = ggml.ggml_mul_mat_id(c, up_b, z3, ids)
    hidden = situ(g, gate, up)
    if g.wants(taps.IMATRIX):
        for name, x in zip(names, (z3, z3, hidden)):
            taps.record_expert_input_sq(g, f"blk.{w.layer}.{name}", x, routed_ids, g.cfg.num_experts)
    return ggml.ggml_mul_mat_id(c, down_b, hidden, ids)  # [L, k, T]


def build_moe(g: GraphBuild, w, x):
    """LatentMoE on the normed input x [n_embd, T] (D.6)."""
    c, cfg, T = g.ctx, g.cfg, g.n_tokens
    ids, weights = _route(g, w, x)
    z = g.mm(w("ffn_routed_down.weight"), x)  # [L, T]
    outputs = _routed_experts(g, w, z, ids)  # [L, k, T]
    if g.wants(taps.MOE_NORMS):
        taps.record_slot_norms(g, w.layer, outputs)
    per_expert = ggml.ggml_mul(c, outputs, weights)
    L, nb1, nb2 = cfg.latent_size, per_expert.contents.nb[1], per_expert.contents.nb[2]
    u = None
    for j in range(cfg.num_experts_used):
        term = ggml.ggml_view_2d(c, per_expert, L, T, nb2, j * nb1)
        u = term if u is None else ggml.ggml_add(c, u, term)
    routed = g.mm(w("ffn_routed_up.weight"), g.rms_norm(u, w("ffn_routed_norm.weight"), cfg.rms_norm_eps))
    shared = situ_mlp(g, x, w("ffn_gate_shexp.weight"), w("ffn_up_shexp.weight"), w("ffn_down_shexp.weight"))
    return ggml.ggml_add(c, routed, shared)


def build_dense_ffn(g: GraphBuild, w, x):
    """The leading dense layers' SiTU MLP (D.7)."""
    return situ_mlp(g, x, w("ffn_gate.weight"), w("ffn_up.weight"), w("ffn_down.weight"))
