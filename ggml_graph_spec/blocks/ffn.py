"""The SiTU MLP (docs/reference/forward.md#situ) and the leading dense layers' FFN (#output-head).

Activations are F32 with ne = [width, n_tokens] (one sequence).
"""
from __future__ import annotations

import ggml

from gguf_arch.arch.tensors import FFN_DOWN, FFN_GATE, FFN_NORM, FFN_UP

from ..graph.build import GraphBuild, Tensor
from ..weights.loader import LayerWeights


def ffn_norm(g: GraphBuild, w: LayerWeights, y: Tensor) -> Tensor:
    """Layer w's FFN input norm on the residual mix y [n_embd, T]."""
    return g.rms_norm(y, w(FFN_NORM), g.cfg.rms_norm_eps)


def situ(g: GraphBuild, gate: Tensor, up: Tensor) -> Tensor:
    """[b1*tanh(gate/b1)*sigmoid(gate)] * [b2*tanh(up/b2)], in F32 (docs/reference/forward.md#situ)."""
    c, b1, b2 = g.ctx, g.cfg.situ_beta, g.cfg.situ_linear_beta
    capped_gate = ggml.ggml_scale(c, ggml.ggml_tanh(c, ggml.ggml_scale(c, gate, 1.0 / b1)), b1)
    capped_up = ggml.ggml_scale(c, ggml.ggml_tanh(c, ggml.ggml_scale(c, up, 1.0 / b2)), b2)
    return ggml.ggml_mul(c, ggml.ggml_mul(c, capped_gate, ggml.ggml_sigmoid(c, gate)), capped_up)


def situ_mlp(g: GraphBuild, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """W_down(situ(W_gate x, W_up x)): the dense layer-0 FFN and the shared experts
    (docs/reference/forward.md#situ)."""
    return g.mm(w_down, situ(g, g.mm(w_gate, x), g.mm(w_up, x)))


def build_dense_ffn(g: GraphBuild, w: LayerWeights, x: Tensor) -> Tensor:
    """The leading dense layers' SiTU MLP (docs/reference/forward.md#output-head)."""
    return situ_mlp(g, x, w(FFN_GATE), w(FFN_UP), w(FFN_DOWN))
