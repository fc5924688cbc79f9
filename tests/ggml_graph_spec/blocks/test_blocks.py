"""Each block builder against a numpy transcription of docs/reference/forward.md on small random weights.

The shapes come from the k3-tiny config through the tensor table, so the blocks see exactly
the GGUF layouts (ssm_a = -exp(A_log), conv weights (1, P, 1, K), MXFP4 expert stacks).
Tolerance 2e-5 relative to the output scale: F32 with different summation orders.
"""
from __future__ import annotations

from functools import partial

import ggml
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from gguf_arch.arch.config import load_config
from gguf_arch.arch.tensors import ATTN_K, ATTN_Q, OUT_MXFP4, layer_name, plan_tensors
from ggml_graph_spec.blocks.attn_res import ResidualBank, attn_res
from ggml_graph_spec.blocks.ffn import situ
from ggml_graph_spec.blocks.kda import build_kda
from ggml_graph_spec.blocks.moe import build_moe
from ggml_graph_spec.graph.cache import SequenceCache
from ggml_graph_spec.backends.cpu import Executor
from ggml_graph_spec.graph.build import F32, REFERENCE_QK_LATENT_EPS, GraphBuild, new_tensor
from ggml_graph_spec.weights.loader import LayerWeights

RTOL = 2e-5


@pytest.fixture(scope="module")
def cfg(k3_tiny_dir):
    return load_config(k3_tiny_dir)


@pytest.fixture(scope="module")
def exe():
    e = Executor(n_threads=1)
    yield e
    e.free()


def _random_weight(rng, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("ssm_a"):
        return -np.exp(rng.uniform(-1, 1, shape))
    if "norm" in name:
        return 1 + 0.1 * rng.standard_normal(shape)
    if name.endswith(("ssm_dt.bias", "exp_probs_b.bias")):
        return rng.standard_normal(shape)
    if "conv1d" in name:
        return 0.5 * rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1])


class RandomLayer:
    """A layer's tensors with random values: ggml tensors (`w`) and their numpy values (`np`)."""

    def __init__(self, cfg, layer: int, exe: Executor, seed: int, scale: dict[str, float] | None = None):
        """scale: factors for some of the weights, by GGUF tensor name."""
        rng = np.random.default_rng(seed)
        scale = scale or {}
        planned = [p for p in plan_tensors(cfg) if p.layer == layer and not p.spec.optional]
        self._ctx = ggml.ggml_init(ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * len(planned), mem_buffer=None, no_alloc=True))
        self.np: dict[str, np.ndarray] = {}
        tensors, data = {}, {}
        for p in planned:
            value = (scale.get(p.name, 1.0) * _random_weight(rng, p.name, p.shape)).astype(np.float32)
            if p.spec.out == OUT_MXFP4:
                raw = quantize(value, Q.MXFP4)
                self.np[p.name] = dequantize(raw, Q.MXFP4)
                tensors[p.name] = new_tensor(self._ctx, ggml.GGML_TYPE_MXFP4, tuple(reversed(p.shape)))
            else:
                raw = self.np[p.name] = value
                tensors[p.name] = new_tensor(self._ctx, F32, tuple(reversed(p.shape)))
            data[p.name] = np.ascontiguousarray(raw)
            ggml.ggml_set_name(tensors[p.name], p.name.encode())  # as the loader names them (taps read it)
        self._buffer = ggml.ggml_backend_alloc_ctx_tensors(self._ctx, exe.backend)
        for name, raw in data.items():
            ggml.ggml_backend_tensor_set(tensors[name], raw.ctypes.data, 0, raw.nbytes)
        self.w = LayerWeights(cfg, layer, tensors)
        self.layer = layer

    def __call__(self, suffix: str) -> np.ndarray:
        return self.np[f"blk.{self.layer}.{suffix}"]

    def free(self) -> None:
        ggml.ggml_backend_buffer_free(self._buffer)
        ggml.ggml_free(self._ctx)


def run_block(exe: Executor, cfg, cache, build, xs: list[np.ndarray], *, exact: bool = True) -> np.ndarray:
    """Run build(g, *inputs) on numpy inputs (activations [T, width]; T from the first one)."""
    T = xs[0].shape[0]
    make = partial(GraphBuild, cfg=cfg, cache=cache, n_tokens=T, exact=exact, top_k=None)
    with exe.graph(4096, make) as g:
        inputs = [g.input(f"x{i}", F32, tuple(reversed(x.shape)), x) for i, x in enumerate(xs)]
        out = build(g, *inputs)
        exe.compute(g, [out])
        result = exe.read(out)
    cache.n_past += T
    return result


def _close(got: np.ndarray, want: np.ndarray, rtol: float = RTOL) -> None:
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= rtol * scale, f"max |diff| {np.abs(got - want).max():.3g}, scale {scale:.3g}"


# ---- numpy references (docs/reference/forward.md) ---------------------------------------------

def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_rmsnorm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def np_situ(gate, up, b1, b2):
    return b1 * np.tanh(gate / b1) * np_sigmoid(gate) * b2 * np.tanh(up / b2)


def np_kda(cfg, L: RandomLayer, x: np.ndarray, l2_eps: float = REFERENCE_QK_LATENT_EPS) -> np.ndarray:
    kda, T = cfg.kda, x.shape[0]
    S, H, P, K = kda.head_dim, kda.num_heads, kda.proj_dim, kda.conv_kernel
    qkv = {}
    for n in "qkv":
        u = x @ L(f"attn_{n}.weight").T
        w = L(f"ssm_conv1d_{n}.weight").reshape(P, K)  # w[c, K-1] multiplies the current token
        padded = np.concatenate([np.zeros((K - 1, P)), u])
        conv = np.stack([(padded[t:t + K] * w.T).sum(0) for t in range(T)])
        qkv[n] = (conv * np_sigmoid(conv)).reshape(T, H, S)
    l2 = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + l2_eps)  # noqa: E731
    q, k, v = l2(qkv["q"]) * S ** -0.5, l2(qkv["k"]), qkv["v"]
    s = ((x @ L("ssm_f_a.weight").T) @ L("ssm_f_b.weight").T + L("ssm_dt.bias")).reshape(T, H, S)
    g = kda.gate_lower_bound * np_sigmoid(-L("ssm_a")[None, :, None] * s)
    beta = np_sigmoid(x @ L("ssm_beta.weight").T)
    state = np.zeros((H, S, S))  # [h, key, value]
    o = np.zeros((T, H, S))
    for t in range(T):
        for h in range(H):
            state[h] *= np.exp(g[t, h])[:, None]
            err = v[t, h] - state[h].T @ k[t, h]
            state[h] += beta[t, h] * np.outer(k[t, h], err)
            o[t, h] = state[h].T @ q[t, h]
    gate = np_sigmoid((x @ L("ssm_g.weight").T).reshape(T, H, S))
    o = np_rmsnorm(o, L("ssm_norm.weight"), cfg.rms_norm_eps) * gate
    return o.reshape(T, P) @ L("attn_output.weight").T


def np_attn_res(values: list[np.ndarray], score: np.ndarray, eps: float) -> np.ndarray:
    V = np.stack(values)  # [K, T, H]
    keys = V / np.sqrt(np.mean(V * V, -1, keepdims=True) + eps)
    logits = keys @ score  # [K, T]
    p = np.exp(logits - logits.max(0))
    p /= p.sum(0)
    return (p[..., None] * V).sum(0)


def np_moe(cfg, L: RandomLayer, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    k = cfg.num_experts_used
    probs = np_sigmoid(x @ L("ffn_gate_inp.weight").T)
    picked = np.argsort(-(probs + L("exp_probs_b.bias")), axis=1, kind="stable")[:, :k]
    z = x @ L("ffn_routed_down.weight").T
    u = np.zeros_like(z)
    for t in range(x.shape[0]):
        w = probs[t, picked[t]] / probs[t, picked[t]].sum() * cfg.routed_scaling_factor
        for e, we in zip(picked[t], w):
            h = np_situ(L("ffn_gate_exps.weight")[e] @ z[t], L("ffn_up_exps.weight")[e] @ z[t],
                        cfg.situ_beta, cfg.situ_linear_beta)
            u[t] += we * (L("ffn_down_exps.weight")[e] @ h)
    routed = np_rmsnorm(u, L("ffn_routed_norm.weight"), cfg.rms_norm_eps) @ L("ffn_routed_up.weight").T
    shared = np_situ(x @ L("ffn_gate_shexp.weight").T, x @ L("ffn_up_shexp.weight").T,
                     cfg.situ_beta, cfg.situ_linear_beta) @ L("ffn_down_shexp.weight").T
    return routed + shared, picked


# ---- tests ------------------------------------------------------------------------------------

def test_situ_matches_the_formula_and_saturates(cfg, exe):
    gate = np.linspace(-300, 300, 64 * 6, dtype=np.float32).reshape(6, 64)
    up = gate[::-1].copy() * 0.7
    cache = SequenceCache(cfg, exe.backend, n_ctx=8, exact=True, with_indexer=False)
    try:
        got = run_block(exe, cfg, cache, situ, [gate, up])
    finally:
        cache.free()
    want = np_situ(gate.astype(np.float64), up, cfg.situ_beta, cfg.situ_linear_beta)
    _close(got, want)
    assert np.abs(got).max() <= cfg.situ_beta * cfg.situ_linear_beta


def test_kda_prefill_then_continue_matches_the_delta_rule(cfg, exe):
    """Two calls (5 + 3 tokens) through the conv and recurrent states equal one 8-token pass."""
    layer = cfg.kda.layers[1]
    L = RandomLayer(cfg, layer, exe, seed=1)
    cache = SequenceCache(cfg, exe.backend, n_ctx=16, exact=True, with_indexer=False)
    try:
        x = np.random.default_rng(2).standard_normal((8, cfg.hidden_size)).astype(np.float32)
        build = lambda g, xt: build_kda(g, L.w, xt)  # noqa: E731
        got = np.concatenate([run_block(exe, cfg, cache, build, [x[:5]]),
                              run_block(exe, cfg, cache, build, [x[5:]])])
        _close(got, np_kda(cfg, L, x.astype(np.float64)))
        cache.reset()
        _close(run_block(exe, cfg, cache, build, [x[:5]]), np_kda(cfg, L, x[:5].astype(np.float64)))
    finally:
        cache.free()
        L.free()


@pytest.mark.parametrize("exact", [True, False])
def test_kda_l2_eps_is_the_reference_one_exact_and_llama_cpp_one_fast(cfg, exe, exact):
    """q/k projections 1e-3 times smaller make sum(q^2) ~4e-6, so the L2-norm eps decides the
    output: the exact path must be the reference (1e-6), the fast path llama.cpp (rms_norm_eps)."""
    layer = cfg.kda.layers[1]
    L = RandomLayer(cfg, layer, exe, seed=6, scale={layer_name(t, layer): 1e-3 for t in (ATTN_Q, ATTN_K)})
    cache = SequenceCache(cfg, exe.backend, n_ctx=8, exact=exact, with_indexer=False)
    try:
        x = np.random.default_rng(7).standard_normal((4, cfg.hidden_size)).astype(np.float32)
        got = run_block(exe, cfg, cache, lambda g, xt: build_kda(g, L.w, xt), [x], exact=exact)
        ours, other = REFERENCE_QK_LATENT_EPS, cfg.rms_norm_eps
        if not exact:
            ours, other = other, ours
        _close(got, np_kda(cfg, L, x.astype(np.float64), ours))
        assert np.abs(got - np_kda(cfg, L, x.astype(np.float64), other)).max() > 0.1 * np.abs(got).max()
    finally:
        cache.free()
        L.free()


def test_attn_res_mixes_raw_values_by_normed_scores(cfg, exe):
    rng = np.random.default_rng(3)
    T, H = 4, cfg.hidden_size
    # Candidates of very different scales: mixing normed values instead of raw ones would show.
    values = [(rng.standard_normal((T, H)) * s).astype(np.float32) for s in (0.5, 3.0, 1.0, 8.0)]
    score = (rng.standard_normal(H) * 0.3).astype(np.float32)

    def build(g, *xs):
        *banked, p, score_t = xs
        bank = ResidualBank()
        for v in banked:
            bank.push(g, v)
        return attn_res(g, p, bank, score_t)

    cache = SequenceCache(cfg, exe.backend, n_ctx=8, exact=True, with_indexer=False)
    try:
        got = run_block(exe, cfg, cache, build, values + [score])
    finally:
        cache.free()
    _close(got, np_attn_res([v.astype(np.float64) for v in values], score, cfg.rms_norm_eps))


@pytest.mark.parametrize("exact", [True, False])
def test_latent_moe(cfg, exe, exact):
    """Exact path: numpy with the dequantized experts to F32 noise. Fast path: ggml's MXFP4
    kernel quantizes the activations to 8 bits (docs/reference/findings.md: ~1% per layer), bound 3%."""
    layer = cfg.moe_layers[0]
    L = RandomLayer(cfg, layer, exe, seed=4)
    cache = SequenceCache(cfg, exe.backend, n_ctx=16, exact=exact, with_indexer=False)
    try:
        x = np.random.default_rng(5).standard_normal((7, cfg.hidden_size)).astype(np.float32)
        want, picked = np_moe(cfg, L, x.astype(np.float64))
        probs = np_sigmoid(x @ L("ffn_gate_inp.weight").T)
        unbiased = np.argsort(-probs, axis=1)[:, :cfg.num_experts_used]
        assert any(set(a) != set(b) for a, b in zip(picked, unbiased)), "the bias must change a selection here"
        got = run_block(exe, cfg, cache, lambda g, xt: build_moe(g, L.w, xt), [x], exact=exact)
        _close(got, want, RTOL if exact else 3e-2)
    finally:
        cache.free()
        L.free()


@pytest.mark.parametrize("n_tokens", [1, 7])
def test_routed_experts_by_slot_are_the_batched_ones_bit_for_bit(cfg, exe, n_tokens):
    """The fast path's routed experts one slot at a time (what a memory budget's executor runs,
    moe._routed_experts_by_slot) give exactly the batched mul_mat_id's values, for one token and
    for a batch whose tokens share experts in different slots."""
    from ggml_graph_spec.blocks.moe import _routed_experts, _routed_experts_by_slot
    from ggml_graph_spec.graph.build import I32
    from gguf_arch.arch.tensors import FFN_DOWN_EXPS, FFN_GATE_EXPS, FFN_UP_EXPS
    L = RandomLayer(cfg, cfg.moe_layers[0], exe, seed=6)
    cache = SequenceCache(cfg, exe.backend, n_ctx=16, exact=False, with_indexer=False)
    rng = np.random.default_rng(7)
    k, E = cfg.num_experts_used, cfg.num_experts
    ids = np.stack([rng.permutation(min(E, k + 2))[:k] for _ in range(n_tokens)]).astype(np.int32)  # shared experts
    z = rng.standard_normal((n_tokens, cfg.latent_size)).astype(np.float32)
    stacks = [L.w(n) for n in (FFN_GATE_EXPS, FFN_UP_EXPS, FFN_DOWN_EXPS)]

    def routed(by_slot: bool):
        def build(g, zt):
            it = g.input("ids", I32, (k, n_tokens), ids)
            return _routed_experts_by_slot(g, zt, it, stacks) if by_slot else _routed_experts(g, L.w, zt, it)
        cache.n_past = 0
        return run_block(exe, cfg, cache, build, [z], exact=False)
    try:
        batched, by_slot = routed(False), routed(True)
        assert batched.shape == by_slot.shape and batched.size == n_tokens * k * cfg.latent_size
        assert np.array_equal(batched, by_slot)
        assert np.abs(batched).max() > 0
    finally:
        cache.free()
        L.free()
