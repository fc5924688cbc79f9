"""The K3.1-Pro indexer and its masked sparse-flash path against numpy references of the contract
(docs/reference/dsa.md#indexer-math): scores, the tie-exact top-k selection, the mask, DSA attention."""
from __future__ import annotations

import ggml
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ggml_graph_spec.blocks import dsa, mla
from ggml_graph_spec.graph.build import causal_mask
from gguf_arch.arch.config import load_config

from tests.support import attn_reference as ref
from tests.support.attn_graph import AttnGraph
from tests.support.paths import K31PRO_TINY as FIXTURE

N_CTX = 16
EXACT_TOL = 1e-5  # F32 graph vs float64 reference, O(1) values (as in test_mla)


@pytest.fixture(scope="module")
def cfg():
    return ref.odd_sized(load_config(FIXTURE))


@pytest.fixture(scope="module")
def layer(cfg):
    return cfg.indexer.layers[0]


def _inputs(cfg, seed: int, n: int = 9, key_bias: bool = False):
    rng = np.random.default_rng(seed)
    W = ref.random_attention_weights(cfg, cfg.indexer.layers[0], rng, key_bias=key_bias)
    return W, rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)


def _positions(selected: np.ndarray, n_past: int) -> list[np.ndarray]:
    """Recorded [T, k] rows -> the visible selected positions of each query, ascending."""
    return [np.sort(row[row <= n_past + t]) for t, row in enumerate(selected)]


# ---- indexer scores ------------------------------------------------------------------------

@pytest.mark.parametrize("key_bias", [False, True])
def test_indexer_scores_match_contract(cfg, layer, key_bias):
    W, x = _inputs(cfg, 0, key_bias=key_bias)
    _, rec = AttnGraph(cfg, layer, W, N_CTX).eval(mla.build_mla, x, top_k=N_CTX, want=("index_scores",))
    want = ref.indexer_scores(cfg, W, x)
    got = rec["index_scores"]
    assert np.array_equal(np.isneginf(got), np.isneginf(want))  # exactly the causal pattern
    visible = np.isfinite(want)
    np.testing.assert_allclose(got[visible], want[visible], rtol=0, atol=EXACT_TOL)


def test_key_bias_case_discriminates(cfg, layer):
    """The bias moves the scores far beyond the tolerance, so the key_bias case above checks it."""
    W, x = _inputs(cfg, 0, key_bias=True)
    no_bias = {k: v for k, v in W.items() if k != "indexer.k_norm.bias"}
    with_bias = ref.indexer_scores(cfg, W, x)
    visible = np.isfinite(with_bias)
    assert np.abs(with_bias[visible] - ref.indexer_scores(cfg, no_bias, x)[visible]).max() > 1e3 * EXACT_TOL


# ---- the selection: exact, ties to the lower position --------------------------------------

def _run_selection(scores: np.ndarray, n_past: int, top_k: int, cfg, layer) -> np.ndarray:
    """dsa.selection_mask on given scores [T, n_kv] (already causally masked) -> [T, n_kv]."""
    T, n_kv = scores.shape
    graph = AttnGraph(cfg, layer, {}, n_kv)
    graph.n_past = n_past

    def build(g, w, x):
        return dsa.selection_mask(g, g.input("scores", ggml.GGML_TYPE_F32, (n_kv, T), scores), top_k)

    return graph.eval(build, np.zeros((T, cfg.hidden_size), np.float32))[0]


def _reference_mask(scores: np.ndarray, n_past: int, top_k: int) -> np.ndarray:
    return ref.selection_mask(ref.select(scores, top_k, n_past), scores.shape[1]).astype(np.float32)


def _masked(values: np.ndarray, n_past: int) -> np.ndarray:
    return (values + causal_mask(n_past, values.shape[0])).astype(np.float32)


# ggml's CPU sorts (std::sort) fall back to a stable insertion sort below 16 elements, so rows
# must be longer than that for an unstable tie order to show at all.
LONG_ROW = 40


def test_ties_at_zero_go_to_the_lower_position(cfg, layer):
    """Rows of exact zeros (every head's q.k <= 0) and -0.0 == +0.0: the first positions win."""
    n_past = LONG_ROW - 4
    values = np.zeros((4, LONG_ROW), np.float32)
    values[1, [30, 7]] = 2.0  # two clear winners, then ties among the zeros
    values[2, ::3] = -0.0
    values[3, [3, 20, 33]] = [0.5, -1.0, 1e-30]  # 1e-30 > 0
    scores = _masked(values, n_past)
    got = _run_selection(scores, n_past, 4, cfg, layer)
    assert np.array_equal(got, _reference_mask(scores, n_past, 4))
    assert np.flatnonzero(got[0] == 0).tolist() == [0, 1, 2, 3]
    assert np.flatnonzero(got[1] == 0).tolist() == [0, 1, 7, 30]
    assert np.flatnonzero(got[2] == 0).tolist() == [0, 1, 2, 3]
    assert np.flatnonzero(got[3] == 0).tolist() == [0, 1, 3, 33]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_selection_equals_stable_sort(cfg, layer, data):
    """Scores drawn from a handful of values (many exact ties), any top_k, prefill or decode."""
    T = data.draw(st.integers(1, 4), label="T")
    n_past = data.draw(st.integers(0, LONG_ROW), label="n_past")
    top_k = data.draw(st.integers(1, n_past + T + 2), label="top_k")
    pool = st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.25, 3.0])
    values = np.array(data.draw(st.lists(st.lists(pool, min_size=n_past + T, max_size=n_past + T),
                                         min_size=T, max_size=T)), np.float32)
    scores = _masked(values, n_past)
    assert np.array_equal(_run_selection(scores, n_past, top_k, cfg, layer), _reference_mask(scores, n_past, top_k))


# ---- DSA attention ---------------------------------------------------------------------------

@pytest.mark.parametrize("exact", [True, False])
def test_top_k_at_context_is_dense_bit_for_bit(cfg, layer, exact):
    W, x = _inputs(cfg, 1)
    dense, _ = AttnGraph(cfg, layer, W, N_CTX, exact=exact).eval(mla.build_mla, x)
    for top_k in (len(x), 2048):
        sparse, _ = AttnGraph(cfg, layer, W, N_CTX, exact=exact).eval(mla.build_mla, x, top_k=top_k)
        assert np.array_equal(sparse, dense)


@pytest.mark.parametrize("top_k", [1, 3])
def test_sparse_attention_matches_reference(cfg, layer, top_k):
    W, x = _inputs(cfg, 2)
    y, rec = AttnGraph(cfg, layer, W, N_CTX).eval(mla.build_mla, x, top_k=top_k, want=("index_selected",))
    selected = ref.select(ref.indexer_scores(cfg, W, x), top_k)
    assert rec["index_selected"].shape == (len(x), top_k)
    assert [s.tolist() for s in _positions(rec["index_selected"], 0)] == [s.tolist() for s in selected]
    mask = causal_mask(0, len(x)) + ref.selection_mask(selected, len(x))
    want = ref.mla(cfg, W, x, mask)
    np.testing.assert_allclose(y, want, rtol=0, atol=EXACT_TOL)
    dense = ref.mla(cfg, W, x, causal_mask(0, len(x)))
    assert np.abs(y[top_k:] - dense[top_k:]).max(axis=1).min() > 100 * EXACT_TOL  # every sparse row moved
    np.testing.assert_allclose(y[:top_k], dense[:top_k], rtol=0, atol=EXACT_TOL)


def test_fast_path_sparse_within_f16_bound(cfg, layer):
    W, x = _inputs(cfg, 2)
    y, rec = AttnGraph(cfg, layer, W, N_CTX, exact=False).eval(mla.build_mla, x, top_k=3, want=("index_selected",))
    selected = ref.select(ref.indexer_scores(cfg, W, x), 3)
    assert [s.tolist() for s in _positions(rec["index_selected"], 0)] == [s.tolist() for s in selected]
    want = ref.mla(cfg, W, x, causal_mask(0, len(x)) + ref.selection_mask(selected, len(x)))
    assert np.abs(y - want).max() / np.abs(want).max() < 4e-3  # test_mla.FAST_REL_TOL's argument


def test_decode_scores_every_cached_key(cfg, layer):
    """Prefill 4, then 1, 1 and 3 tokens: the selection of each new query is made over the
    indexer keys of all earlier calls, and equals the full-sequence selection."""
    W, x = _inputs(cfg, 3)
    top_k = 3
    selected = ref.select(ref.indexer_scores(cfg, W, x), top_k)
    want = ref.mla(cfg, W, x, causal_mask(0, len(x)) + ref.selection_mask(selected, len(x)))
    graph = AttnGraph(cfg, layer, W, N_CTX)
    ys, got = [], []
    for a, b in ((0, 4), (4, 5), (5, 6), (6, 9)):
        y, rec = graph.eval(mla.build_mla, x[a:b], top_k=top_k, want=("index_selected",))
        ys.append(y)
        got += _positions(rec["index_selected"], a)
    assert [s.tolist() for s in got] == [s.tolist() for s in selected]
    np.testing.assert_allclose(np.concatenate(ys), want, rtol=0, atol=EXACT_TOL)
