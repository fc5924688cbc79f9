"""Kimi Delta Attention (docs/reference/forward.md#kda): short convolutions, L2-normed q/k, the gated
delta rule over the layer's recurrent state, and the gated output norm.

Layout (ggml `ne` order): x [n_embd, T] over every token of the micro-batch; q, k, v
[head_dim, heads, T]; the conv states [K-1, P, n_seq] and the recurrent states
[head_dim, head_dim, heads, n_seq] live in the sequence cache. Everything but the short
convolutions and the delta rule works token by token on all T at once; those two run once per
group of same-length runs (graph/ubatch.py), the group's sequences in the ops' 4th dimension.
"""
from __future__ import annotations

import ggml

from gguf_arch.arch.tensors import (ATTN_K, ATTN_OUTPUT, ATTN_Q, ATTN_V, SSM_A, SSM_BETA, SSM_CONV1D, SSM_DT,
                                    SSM_F_A, SSM_F_B, SSM_G, SSM_NORM)

from ..graph.build import GraphBuild, Tensor
from ..graph.ubatch import RunGroup
from ..weights.loader import LayerWeights

def _l2_norm_heads(g: GraphBuild, x: Tensor, head_dim: int) -> Tensor:
    """x / sqrt(sum(x^2) + eps) per head, as rms_norm(x, eps/d) / sqrt(d) (same value exactly).

    eps: g.qk_latent_eps (the reference's 1e-6, fla's q/k pre-processing in chunk_kda /
    fused_recurrent_kda, is one of the traps the fixture discriminates)."""
    eps = g.qk_latent_eps
    return ggml.ggml_scale(g.ctx, ggml.ggml_rms_norm(g.ctx, x, eps / head_dim), head_dim ** -0.5)


def _consecutive(group: RunGroup) -> bool:
    """The group's sequences are s, s+1, ...: their planes are one view, no gather or scatter (a
    server's slots decoding together usually are)."""
    seqs = group.seqs
    return seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def _load_planes(g: GraphBuild, state: Tensor, group: RunGroup) -> Tensor:
    """The group's planes of a state [..., n_seq], flat [plane x m]: a view when the sequences are
    consecutive (one sequence always is, as a single-sequence graph always read it), else gathered."""
    if _consecutive(group):
        return g.plane(state, group.seqs[0], len(group.runs))
    return g.gather_planes(state, group.seqs)


def _store_planes(g: GraphBuild, state: Tensor, src: Tensor, group: RunGroup) -> None:
    """Write the group's new planes (src, plane elements x m) back into the state."""
    if _consecutive(group):
        dst = g.plane(state, group.seqs[0], len(group.runs))
        src = ggml.ggml_cont(g.ctx, src) if not ggml.ggml_is_contiguous(src) else src
        g.expand(ggml.ggml_cpy(g.ctx, ggml.ggml_reshape_1d(g.ctx, src, ggml.ggml_nelements(src)), dst))
    else:
        g.scatter_planes(state, src, group.seqs)


def _tokens(g: GraphBuild, t: Tensor, group: RunGroup) -> Tensor:
    """The group's columns of t [rows, T] (the whole of t when the group is the micro-batch)."""
    n = group.n_tokens * len(group.runs)
    if n == g.n_tokens:
        return t
    return ggml.ggml_view_2d(g.ctx, t, t.contents.ne[0], n, t.contents.nb[1], group.offset * t.contents.nb[1])


def _short_conv(g: GraphBuild, w: LayerWeights, which: str, u: Tensor, group: RunGroup) -> Tensor:
    """Depthwise causal conv (kernel K, no bias) over [cached K-1 inputs | u], then SiLU, for each
    run of the group: u [P, T*m] -> [P, T*m]. The conv state keeps the last K-1 inputs."""
    c, kda = g.ctx, g.cfg.kda
    P, K, T, m = kda.proj_dim, kda.conv_kernel, group.n_tokens, len(group.runs)
    state = g.cache.kda_conv(w.layer, which)
    past = ggml.ggml_reshape_3d(c, _load_planes(g, state, group), K - 1, P, m)
    new = ggml.ggml_cont(c, ggml.ggml_permute(c, ggml.ggml_reshape_3d(c, u, P, T, m), 1, 0, 2, 3))  # [T, P, m]
    sx = ggml.ggml_concat(c, past, new, 0)  # [K-1+T, P, m]
    kernel = ggml.ggml_reshape_2d(c, w(SSM_CONV1D[which]), K, P)
    y = ggml.ggml_ssm_conv(c, sx, kernel)  # [P, T, m]
    elem = ggml.ggml_element_size(sx)
    _store_planes(g, state, ggml.ggml_view_3d(c, sx, K - 1, P, m, sx.contents.nb[1], sx.contents.nb[2], T * elem),
                  group)
    return ggml.ggml_silu(c, ggml.ggml_reshape_2d(c, y, P, T * m))


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


def _delta_rule(g: GraphBuild, w: LayerWeights, q: Tensor, k: Tensor, v: Tensor, gate: Tensor, beta: Tensor,
                group: RunGroup) -> Tensor:
    """The gated delta rule over the group's runs, from and into their recurrent states:
    q, k, v, gate [S, H, T*m], beta [1, H, T*m] -> outputs [S, H, T*m]."""
    c, kda = g.ctx, g.cfg.kda
    S, H, T, m = kda.head_dim, kda.num_heads, group.n_tokens, len(group.runs)
    state = g.cache.kda_state(w.layer)

    def seqs(t: Tensor) -> Tensor:  # [a, H, T*m] -> [a, H, T, m], the group's columns
        cols = _tokens(g, ggml.ggml_reshape_2d(c, t, t.contents.ne[0] * H, g.n_tokens), group)
        return ggml.ggml_reshape_4d(c, cols, t.contents.ne[0], H, T, m)
    s0 = ggml.ggml_reshape_4d(c, _load_planes(g, state, group), S, S, H, m)
    # The op scales q by 1/sqrt(S) itself and returns [outputs | final states]
    # (docs/reference/findings.md#ggml-ops-from-python).
    out = ggml.ggml_gated_delta_net(c, seqs(q), seqs(k), seqs(v), seqs(gate), seqs(beta), s0, 1)
    elem = ggml.ggml_element_size(out)
    _store_planes(g, state, ggml.ggml_view_2d(c, out, S * S * H, m, S * S * H * elem, S * H * T * m * elem), group)
    return ggml.ggml_view_3d(c, out, S, H, T * m, S * elem, S * H * elem, 0)


def build_kda(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """Kimi Delta Attention on the normed input x [n_embd, T] -> [n_embd, T]
    (docs/reference/forward.md#kda)."""
    c, kda, T = g.ctx, g.cfg.kda, g.n_tokens
    S, H, P = kda.head_dim, kda.num_heads, kda.proj_dim
    groups = g.ubatch.groups
    proj = [(name, g.mm(w(p), x)) for name, p in (("q", ATTN_Q), ("k", ATTN_K), ("v", ATTN_V))]
    q, k, v = (ggml.ggml_reshape_3d(c, _join(g, [_short_conv(g, w, name, _tokens(g, u, gr), gr) for gr in groups]),
                                    S, H, T) for name, u in proj)
    q, k = _l2_norm_heads(g, q, S), _l2_norm_heads(g, k, S)
    beta = ggml.ggml_reshape_3d(c, ggml.ggml_sigmoid(c, g.mm(w(SSM_BETA), x)), 1, H, T)
    gate = _kda_gate(g, w, x)
    o = _join(g, [_delta_rule(g, w, q, k, v, gate, beta, gr) for gr in groups], dim=2)
    # Gated output norm: rmsnorm over head_dim (weight shared by heads) times sigmoid(g_proj x).
    gate_out = ggml.ggml_reshape_3d(c, g.mm(w(SSM_G), x), S, H, T)
    o = ggml.ggml_mul(c, g.rms_norm(o, w(SSM_NORM), g.cfg.rms_norm_eps), ggml.ggml_sigmoid(c, gate_out))
    return g.mm(w(ATTN_OUTPUT), ggml.ggml_reshape_2d(c, o, P, T))


def _join(g: GraphBuild, parts: list[Tensor], dim: int = 1) -> Tensor:
    """The groups' results in micro-batch order (concatenated along the token dimension)."""
    out = parts[0]
    for p in parts[1:]:
        out = ggml.ggml_concat(g.ctx, out, p, dim)
    return out
