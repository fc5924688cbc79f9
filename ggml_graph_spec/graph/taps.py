"""Extra outputs for calibration, reduced inside the graph so that one call returns per-weight and
per-expert sums, never the activations of all its tokens.

Builders call these only when the call asked for them (`GraphBuild.wants`); without the request
the graph has not one node more (tests/ggml_graph_spec/test_calibrate.py checks it).

* "imatrix": for every matmul `W x`, the sum over the call's tokens of x squared, per input column
  (llama-imatrix's `in_sum2`); for a 3-D per-head weight one block of columns per head, for the
  routed experts one column block per expert over the tokens routed to it.
* "moe_norms": per token and selected expert, the L2 norm of the expert's output in the latent
  space (REAP's ||e_j(x)||, see ggml_graph_spec/tools/calibrate.py for why the latent space).
"""
from __future__ import annotations

import ggml
import numpy as np

IMATRIX = "imatrix"
MOE_NORMS = "moe_norms"
WANTS = frozenset({IMATRIX, MOE_NORMS})
# Nodes the taps add per layer at most (about 6 per matmul, 20 per expert tensor, a few for the
# norms), on top of the model's own node budget when a call wants them.
NODES_PER_LAYER = 320


def _sum_over_tokens(g, x2):
    """x2 [ne0, T, ne2] -> sum over T, as [ne0, ne2] (ne0 fastest, one block per ne2)."""
    c = g.ctx
    ne = x2.contents.ne
    swapped = ggml.ggml_cont(c, ggml.ggml_permute(c, x2, 1, 0, 2, 3))  # [T, ne0, ne2]
    return ggml.ggml_reshape_2d(c, ggml.ggml_sum_rows(c, swapped), ne[0], ne[2] * ne[3])


def record_input_sq(g, w, x) -> None:
    """in_sum2 of the matmul w x: x [ne0, T] or, for a per-head weight, [ne0, T, heads]."""
    c = g.ctx
    if not ggml.ggml_is_contiguous(x):
        x = ggml.ggml_cont(c, x)
    g.record(IMATRIX, ggml.ggml_get_name(w).decode(), _sum_over_tokens(g, ggml.ggml_sqr(c, x)))


def _transposed(g, t):
    return ggml.ggml_cont(g.ctx, ggml.ggml_transpose(g.ctx, t))


def record_expert_input_sq(g, name: str, x, ids, n_expert: int) -> None:
    """in_sum2 per expert of a mul_mat_id over `ids` [k, T]: x [ne0, k, T] (one input per slot) or
    [ne0, 1, T] (one per token, shared by its k slots). Output [ne0, n_expert]."""
    c = g.ctx
    ne0, per_token, T = x.contents.ne[0], x.contents.ne[1], x.contents.ne[2]
    k = ids.contents.ne[0]
    eye = g.constant("expert_eye", ggml.GGML_TYPE_F32, (n_expert, n_expert), np.eye(n_expert))
    onehot = ggml.ggml_get_rows(c, eye, ggml.ggml_reshape_1d(c, ids, k * T))  # [E, k*T], slot t*k + j
    if per_token == 1:  # the k slots of a token share its input: weigh it by how many pick e (0 or 1)
        per_slot = ggml.ggml_cont(c, ggml.ggml_permute(c, ggml.ggml_reshape_3d(c, onehot, n_expert, k, T), 1, 0, 2, 3))
        select = ggml.ggml_reshape_2d(c, ggml.ggml_sum_rows(c, per_slot), n_expert, T)
    else:
        select = onehot
    x2 = ggml.ggml_reshape_2d(c, ggml.ggml_sqr(c, ggml.ggml_cont(c, x)), ne0, per_token * T)
    # [ne0, E] = x2 select^T: row e sums the squared inputs of the slots routed to e.
    g.record(IMATRIX, name, ggml.ggml_mul_mat(c, _transposed(g, x2), _transposed(g, select)))


def record_slot_norms(g, layer: int, out) -> None:
    """||e_j(x)||_2 per slot of the experts' latent outputs out [L, k, T] -> [k, T]."""
    c = g.ctx
    norms = ggml.ggml_sqrt(c, ggml.ggml_sum_rows(c, ggml.ggml_sqr(c, out)))  # [1, k, T]
    g.record(MOE_NORMS, layer, ggml.ggml_reshape_2d(c, norms, out.contents.ne[1], out.contents.ne[2]))
