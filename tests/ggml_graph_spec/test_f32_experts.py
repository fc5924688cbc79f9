"""Every type the converter can write runs: an all-F32 GGUF (`--outtype f32
--requantize-experts f32`, routed experts F32 instead of MXFP4) on the exact path matches the
fixture's reference as the BF16/MXFP4 GGUF does, and the exact path's chunked dequantization
(GraphBuild.mm) gives the same logits whatever the chunk size."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ggml_graph_spec.blocks import forward
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.graph import build

from tests.support.reference import N_CTX, assert_logits, load_reference


@pytest.mark.parametrize("prompt", ("short", "long"))
def test_all_f32_gguf_exact_path_matches_the_reference(k31pro_f32_gguf, k31pro_tiny_dir, prompt):
    ref = load_reference(k31pro_tiny_dir)
    m = Model.load(k31pro_f32_gguf, n_ctx=N_CTX, exact_experts=True, n_threads=1)
    try:
        assert {t.contents.type for n, t in m.weights.tensors.items() if n.endswith("_exps.weight")} == {Q.F32}
        # Only the protected indexer projections keep the checkpoint's BF16 (quant_rules).
        assert {n.split(".", 2)[2] for n, t in m.weights.tensors.items() if t.contents.type != Q.F32} == {
            "indexer.attn_q_b.weight", "indexer.attn_k.weight"}
        assert_logits(m.eval(ref[f"input_ids_{prompt}"]), ref[f"logits_{prompt}"], f"logits_{prompt}")
    finally:
        m.close()


def test_all_f32_gguf_fast_path_runs_the_f32_experts(k31pro_f32_gguf, k31pro_tiny_dir):
    """mul_mat_id straight on the F32 experts: with no weight to round activations to, the fast
    path differs from the exact one only by its F16 latent cache and flash attention."""
    ref = load_reference(k31pro_tiny_dir)
    m = Model.load(k31pro_f32_gguf, n_ctx=N_CTX, n_threads=1)
    try:
        got, want = m.eval(ref["input_ids_long"]), ref["logits_long"]
        # llama.cpp's F16-cache run of the same F32 weights is 7.8e-5 relative from the
        # reference (tests/interop); 3e-4 as there.
        assert np.abs(got - want).max() < 3e-4 * np.abs(want).max()
    finally:
        m.close()


def test_exact_path_dequantization_chunks_do_not_change_the_logits(k31pro_tiny_gguf, k31pro_tiny_dir, monkeypatch):
    ref = load_reference(k31pro_tiny_dir)
    ids = ref["input_ids_short"]
    m = Model.load(k31pro_tiny_gguf, n_ctx=N_CTX, exact_experts=True, n_threads=1)
    try:
        whole = m.eval(ids)
    finally:
        m.close()
    # 4 KiB: every BF16 matrix of the fixture is cut into many chunks of a few rows.
    monkeypatch.setattr(build, "DEQUANT_CHUNK_BYTES", 4096)
    monkeypatch.setattr(forward, "DEQUANT_CHUNK_BYTES", 4096)
    m = Model.load(k31pro_tiny_gguf, n_ctx=N_CTX, exact_experts=True, n_threads=1)
    try:
        assert m._graph_size > forward.graph_size(m.weights) - 1  # the budget counts the chunks
        chunked = m.eval(ids)
    finally:
        m.close()
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-5 * np.abs(whole).max())
