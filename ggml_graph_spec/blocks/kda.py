"""Kimi Delta Attention (docs/reference/forward.md#kda): short convolutions, L2-normed q/k, the gated
delta rule over the layer's recurrent state, and the gated output norm.

Layout (ggml `ne` order, one sequence): x [n_embd, T]; q, k, v [head_dim, heads, T]; the conv
state [K-1, P] and the recurrent state [head_dim, head_dim, heads] live in the sequence cache.
"""
from __future__ import annotations

import ggml

from gguf_arch.arch.tensors import (ATTN_K, ATTN_OUTPUT, ATTN_Q, ATTN_V, SSM_A, SSM_BETA, SSM_CONV1D, SSM_DT,
                                    SSM_F_A, SSM_F_B, SSM_G, SSM_NORM)

from ..graph.build import GraphBuild, Tensor
from ..weights.loader import LayerWeights

def _l2_norm_heads(g: GraphBuild, x: Tensor, head_dim: int) -> Tensor:
    """x / sqrt(sum(x^2) + eps) per head, as rms_norm(x, eps/d) / sqrt(d) (same value exactly).

    eps: g.qk_latent_eps (the reference's 1e-6, fla's q/k pre-processing in chunk_kda /
    fused_recurrent_kda, is one of the traps the fixture discriminates)."""
    eps = g.qk_latent_eps
    return ggml.ggml_scale(g.ctx, ggml.ggml_rms_norm(g.ctx, x, eps / head_dim), head_dim ** -0.5)


def _short_conv(g: GraphBuild, w: LayerWeights, which: str, u: Tensor) -> Tensor:
    """Depthwise causal conv (kernel K, no bias) over [cached K-1 inputs | u], then SiLU.

    u: [P, T]. The conv state keeps the last K-1 inputs for the next call.
    """
    c, kda, T = g.ctx, g.cfg.kda, g.n_tokens
    P, K = kda.proj_dim, kda.conv_kernel
    state = g.cache.kda_conv(w.layer, which)
    sx = ggml.ggml_concat(c, state, ggml.ggml_cont(c, ggml.ggml_transpose(c, u)), 0)  # [K-1+T, P]
    kernel = ggml.ggml_reshape_2d(c, w(SSM_CONV1D[which]), K, P)
    y = ggml.ggml_ssm_conv(c, ggml.ggml_reshape_3d(c, sx, K - 1 + T, P, 1), kernel)  # [P, T, 1]
    elem = ggml.ggml_element_size(sx)
    g.overwrite(state, ggml.ggml_view_2d(c, sx, K - 1, P, sx.contents.nb[1], T * elem))
    return ggml.ggml_silu(c, ggml.ggml_reshape_2d(c, y, P, T))


def _kda_gate(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """Log-decay g = lb * sigmoid(exp(A_h) * (f_b(f_a(x)) + dt_bias)), per head and channel.

    The GGUF stores ssm_a = -exp(A_log[:H]) (one value per head), so exp(A_h) = -ssm_a.
    """
    c, kda, T = g.ctx, g.cfg.kda, g.n_tokens
    S, H = kda.head_dim, kda.num_heads
    s = g.mm(w(SSM_F_B), g.mm(w(SSM_F_A), x))
    s = ggml.ggml_add(c, ggml.ggml_reshape_3d(c, s, S, H, T), ggml.ggml_reshape_2d(c, w(SSM_DT), S, H))
    exp_a = ggml.ggml_neg(c, ggml.ggml_reshape_2d(c, w(SSM_A), 1, H))
    return ggml.ggml_scale(c, ggml.ggml_sigmoid(c, ggml.ggml_mul(c, s, exp_a)), kda.gate_lower_bound)


def build_kda(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """Kimi Delta Attention on the normed input x [n_embd, T] -> [n_embd, T]
    (docs/reference/forward.md#kda)."""
    c, kda, T = g.ctx, g.cfg.kda, g.n_tokens
    S, H, P = kda.head_dim, kda.num_heads, kda.proj_dim
    q, k, v = (ggml.ggml_reshape_3d(c, _short_conv(g, w, name, g.mm(w(proj), x)), S, H, T)
               for name, proj in (("q", ATTN_Q), ("k", ATTN_K), ("v", ATTN_V)))
    q, k = _l2_norm_heads(g, q, S), _l2_norm_heads(g, k, S)
    beta = ggml.ggml_reshape_4d(c, ggml.ggml_sigmoid(c, g.mm(w(SSM_BETA), x)), 1, H, T, 1)
    gate = _kda_gate(g, w, x)
    state = g.cache.kda_state(w.layer)
    # The op scales q by 1/sqrt(S) itself and returns [outputs | final state]
    # (docs/reference/findings.md#ggml-ops-from-python).
    out = ggml.ggml_gated_delta_net(c, q, k, v, gate, beta, ggml.ggml_reshape_4d(c, state, S, S, H, 1), 1)
    elem = ggml.ggml_element_size(out)
    o = ggml.ggml_view_3d(c, out, S, H, T, S * elem, S * H * elem, 0)
    g.overwrite(state, ggml.ggml_view_1d(c, out, S * S * H, S * H * T * elem))
    # Gated output norm: rmsnorm over head_dim (weight shared by heads) times sigmoid(g_proj x).
    gate_out = ggml.ggml_reshape_3d(c, g.mm(w(SSM_G), x), S, H, T)
    o = ggml.ggml_mul(c, g.rms_norm(o, w(SSM_NORM), g.cfg.rms_norm_eps), ggml.ggml_sigmoid(c, gate_out))
    return g.mm(w(ATTN_OUTPUT), ggml.ggml_reshape_2d(c, o, P, T))
