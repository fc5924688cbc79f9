"""The llama-quantize types the graph accepts (quant_rules/llama_types.py) run in ggml 0.15.3:
get_rows (the exact path's dequantization) gives gguf-py's dequantized values exactly, and
mul_mat_id (the fast path's expert matmul) agrees with the same product in F32.

The 2-bit i-quants are left to tests/interop/test_tiers.py, which has llama-quantize write every
offered type and runs the result in the graph: ggml-python's ggml builds their quantization grids
on first use (ggml_quantize_init), 5 to 25 s each on this machine.
"""
from __future__ import annotations

import ctypes

import ggml
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from quant_rules.llama_types import LLAMA_QUANTIZE_TYPES

K, N, E, T = 256, 32, 4, 3  # row length (one 256-block), rows per expert, experts, tokens
IDS = np.array([[0, 2], [1, 3], [3, 0]], dtype=np.int32)  # two experts per token
I32 = 26  # ggml_type GGML_TYPE_I32
SLOW_GRIDS = {Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S}


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def _quantized(t, w: np.ndarray) -> bytes:
    """ggml's own quantization of w [E*N, K] (llama-quantize calls the same ggml_quantize_chunk)."""
    buf = (ctypes.c_uint8 * (ggml.ggml_row_size(t.value, K) * N * E))()
    importance = np.ones(K, np.float32)  # the very-low-bit types need one; uniform here
    ggml.ggml_quantize_init(t.value)
    ggml.ggml_quantize_chunk(t.value, _ptr(w), ctypes.cast(buf, ctypes.c_void_p), 0, N * E, K, _ptr(importance))
    return bytes(buf)


def _tensor(ctx, ggml_type: int, data: bytes, *ne: int):
    t = ggml.ggml_new_tensor(ctx, ggml_type, len(ne), (ctypes.c_int64 * len(ne))(*ne))
    ctypes.memmove(ggml.ggml_get_data(t), data, len(data))
    return t


def _f32(t, shape) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(t), ctypes.POINTER(ctypes.c_float)), shape=shape).copy()


def _run(t, data: bytes, x: np.ndarray):
    """(mul_mat_id on the quantized experts, get_rows of all experts as F32 [E, N, K])."""
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=16 * 2**20, mem_buffer=None, no_alloc=False))
    try:
        w = _tensor(ctx, t.value, data, K, N, E)
        y = ggml.ggml_mul_mat_id(ctx, w, _tensor(ctx, 0, x.tobytes(), K, 1, T), _tensor(ctx, I32, IDS.tobytes(), 2, T))
        rows = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_2d(ctx, w, K * N, E),
                                  _tensor(ctx, I32, np.arange(E, dtype=np.int32).tobytes(), E))
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, y)
        ggml.ggml_build_forward_expand(gf, rows)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, 2)
        return _f32(y, (T, 2, N)), _f32(rows, (E, N, K))
    finally:
        ggml.ggml_free(ctx)


@pytest.mark.parametrize("t", [t for t in LLAMA_QUANTIZE_TYPES if t not in SLOW_GRIDS], ids=lambda t: t.name)
def test_type_runs_in_the_graphs_ggml(t):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((E * N, K)).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    data = _quantized(t, w)
    y, rows = _run(t, data, x)
    dequantized = quants.dequantize(np.frombuffer(data, np.uint8).reshape(E * N, -1), t).reshape(E, N, K)
    assert np.array_equal(rows, dequantized)
    ref = np.einsum("tk,tjnk->tjn", x.astype(np.float64), dequantized[IDS].astype(np.float64))
    # mul_mat_id first rounds the activations to 8 bits per block (Q8_0 / Q8_K, the types' vec_dot
    # partners): each value moves by up to amax/254 of its block, ~1.2% of sigma for a gaussian
    # block (amax ~3 sigma), so an output moves by ~1.2% of its own scale, and the largest of the
    # 192 outputs sits at ~2.5x that scale: ~0.5% of max|y| typical. Measured 0.5%-0.9% over the
    # types; 2% fails a wrong block layout or expert index (errors of order 100%).
    assert np.abs(y - ref).max() / np.abs(ref).max() < 2e-2
