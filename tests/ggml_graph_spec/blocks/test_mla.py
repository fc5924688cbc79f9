"""The gated NoPE MLA builder (absorbed form, latent cache) against the spec's un-absorbed math."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_graph_spec.blocks import mla
from ggml_graph_spec.graph.build import REFERENCE_QK_LATENT_EPS, causal_mask
from gguf_arch.arch.config import load_config

from tests.support import attn_reference as ref
from tests.support.attn_graph import AttnGraph
from tests.support.paths import K31PRO_TINY as FIXTURE

N_CTX = 16

# Exact path: F32 everywhere, so only summation order separates it from the float64 reference
# (a few ulp of the O(1) activations).
EXACT_TOL = 1e-5
# Fast path: K/V and the mask in F16 (unit roundoff 2^-11 = 4.9e-4), Q rounded to F16 inside
# ggml's CPU flash kernel and V accumulated in F16: a few units of 2^-11 relative to the output
# scale (measured up to 7e-4 of max|y| on these shapes).
FAST_REL_TOL = 4e-3


@pytest.fixture(scope="module")
def cfg():
    return ref.odd_sized(load_config(FIXTURE))


@pytest.fixture(scope="module")
def dense_layer(cfg):
    return cfg.mla_layers[0]


def _inputs(cfg, seed: int, n: int = 9):
    rng = np.random.default_rng(seed)
    W = ref.random_attention_weights(cfg, cfg.mla_layers[0], rng)
    return W, rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_prefill_matches_reference(cfg, dense_layer, seed):
    W, x = _inputs(cfg, seed)
    y, _ = AttnGraph(cfg, dense_layer, W, N_CTX).eval(mla.build_mla, x)
    np.testing.assert_allclose(y, ref.mla(cfg, W, x, causal_mask(0, len(x))), rtol=0, atol=EXACT_TOL)


def test_exact_decode_through_the_cache_matches_full_recompute(cfg, dense_layer):
    """Prefill 4 tokens, then 1, 1 and 3: every row reads the latent rows written by earlier calls."""
    W, x = _inputs(cfg, 3)
    full = ref.mla(cfg, W, x, causal_mask(0, len(x)))
    graph = AttnGraph(cfg, dense_layer, W, N_CTX)
    parts = [graph.eval(mla.build_mla, x[a:b])[0] for a, b in ((0, 4), (4, 5), (5, 6), (6, 9))]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=EXACT_TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_path_within_f16_bound(cfg, dense_layer, seed):
    W, x = _inputs(cfg, seed)
    want = ref.mla(cfg, W, x, causal_mask(0, len(x)))
    y, _ = AttnGraph(cfg, dense_layer, W, N_CTX, exact=False).eval(mla.build_mla, x)
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err < FAST_REL_TOL
    assert err > EXACT_TOL  # it really runs in f16 (otherwise this test checks nothing)


def test_fast_decode_through_the_f16_cache(cfg, dense_layer):
    W, x = _inputs(cfg, 4)
    want = ref.mla(cfg, W, x, causal_mask(0, len(x)))
    graph = AttnGraph(cfg, dense_layer, W, N_CTX, exact=False)
    y = np.concatenate([graph.eval(mla.build_mla, x[a:b])[0] for a, b in ((0, 5), (5, 6), (6, 9))])
    assert np.abs(y - want).max() / np.abs(want).max() < FAST_REL_TOL


@pytest.mark.parametrize("exact", [True, False])
def test_latent_norms_eps_is_the_reference_one_exact_and_llama_cpp_one_fast(cfg, dense_layer, exact):
    """With latents of RMS ~1e-3, eps 1e-5 (the model's rms eps) and 1e-6 differ by ~3x: the
    exact path must match the reference default 1e-6, the fast path llama.cpp's rms_norm_eps."""
    W, x = _inputs(cfg, 5)
    for name in ("attn_q_a.weight", "attn_kv_a_mqa.weight"):
        W[name] = W[name] * 1e-3
    y, _ = AttnGraph(cfg, dense_layer, W, N_CTX, exact=exact).eval(mla.build_mla, x)
    ours, other = (ref.LATENT_EPS, cfg.rms_norm_eps) if exact else (cfg.rms_norm_eps, ref.LATENT_EPS)
    tol = EXACT_TOL if exact else FAST_REL_TOL
    for eps, close in ((ours, True), (other, False)):
        want = ref.mla(cfg, W, x, causal_mask(0, len(x)), latent_eps=eps)
        assert (np.abs(y - want).max() <= tol * np.abs(want).max()) == close, eps
    assert REFERENCE_QK_LATENT_EPS == ref.LATENT_EPS

