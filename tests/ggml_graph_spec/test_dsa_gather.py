"""The gathered DSA path (attention over only each query's top_k cache rows) gives the masked
path's logits: exact path to f32 rounding, prefill and token-by-token decode, with the queries
split into groups (mla.GATHER_CHUNK_BYTES) or not; the fast path on the all-F32 GGUF likewise."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_graph_spec.blocks import mla
from ggml_graph_spec.engine.model import EvalError, Model

from tests.support.reference import N_CTX, load_reference

# The two paths sum the same nonzero softmax terms in different orders (over k gathered rows
# vs over the whole cache with zeros): fp32 rounding, amplified by this random model's depth
# about tenfold (test_model.py). Measured 1.1e-6 relative to the largest logit.
EXACT_REL_TOL = 1e-5
# Fast path: flash attention rounds Q to F16 and its softmax runs over the keys in another order
# (gathered rows vs the whole cache); on the all-F32 GGUF the first DSA layer's output moves by
# 5.6e-5 relative to its largest value (prefill 50, decode 46).
FAST_REL_TOL = 3e-4


def _logits(gguf, path: str, ids, *, exact: bool, top_k: int) -> np.ndarray:
    """Prefill 50 tokens, then decode the rest one at a time."""
    m = Model.load(gguf, n_ctx=N_CTX, exact_experts=exact, top_k=top_k, dsa_path=path, n_threads=2)
    try:
        return np.concatenate([m.eval(ids[:50])] + [m.eval([t]) for t in ids[50:]])
    finally:
        m.close()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("top_k", (3, 8, 40))
def test_gathered_equals_masked_on_the_exact_path(k31pro_tiny_gguf, k31pro_tiny_dir, top_k):
    ids = load_reference(k31pro_tiny_dir)["input_ids_long"]
    masked = _logits(k31pro_tiny_gguf, "masked", ids, exact=True, top_k=top_k)
    gathered = _logits(k31pro_tiny_gguf, "gather", ids, exact=True, top_k=top_k)
    assert _rel(gathered, masked) < EXACT_REL_TOL


def test_gathered_query_groups_do_not_change_the_logits(k31pro_tiny_gguf, k31pro_tiny_dir, monkeypatch):
    ids = load_reference(k31pro_tiny_dir)["input_ids_long"]
    whole = _logits(k31pro_tiny_gguf, "gather", ids, exact=True, top_k=8)
    monkeypatch.setattr(mla, "GATHER_CHUNK_BYTES", 8 * 576 * 4 * 7)  # 7 queries per group
    grouped = _logits(k31pro_tiny_gguf, "gather", ids, exact=True, top_k=8)
    np.testing.assert_array_equal(grouped, whole)


def test_gathered_equals_masked_on_the_fast_path(k31pro_f32_gguf, k31pro_tiny_dir):  # noqa: F811
    """Compared after the first DSA layer, where the two paths first differ: further down, an
    F16-step difference sooner or later flips one of the top-8 choices of a later DSA layer
    (measured: layer 11, position 81), and from there the two runs are different selections."""
    ids = load_reference(k31pro_tiny_dir)["input_ids_long"]
    hidden = {}
    for path in ("masked", "gather"):
        m = Model.load(k31pro_f32_gguf, n_ctx=N_CTX, top_k=8, dsa_path=path, n_threads=2)
        try:
            first = m.cfg.indexer.layers[0]
            runs = [m.run(ids[:50], want=("hidden",))] + [m.run([t], want=("hidden",)) for t in ids[50:]]
            hidden[path] = np.concatenate([r.hidden[first] for r in runs])
        finally:
            m.close()
    assert _rel(hidden["gather"], hidden["masked"]) < FAST_REL_TOL


def test_unknown_dsa_path_is_a_one_line_error(k31pro_tiny_gguf):
    with pytest.raises(EvalError, match=r"--dsa-path \(dsa_path\) must be one of masked, gather"):
        Model.load(k31pro_tiny_gguf, n_ctx=N_CTX, dsa_path="sparse")


def test_default_dsa_path_is_the_faster_one_on_both_kernels(k31pro_tiny_gguf):
    # bench/results/graph.json: gather's attention kernel is faster at every measured context on
    # both kernels, and its whole-model decode is equal to 32k and faster beyond.
    for exact in (True, False):
        m = Model.load(k31pro_tiny_gguf, n_ctx=N_CTX, exact_experts=exact, n_threads=1)
        try:
            assert m.dsa_path == "gather"
        finally:
            m.close()
