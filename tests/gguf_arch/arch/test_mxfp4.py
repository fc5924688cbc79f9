"""MXFP4 repack: compressed-tensors pairs -> ggml block_mxfp4, checked with gguf-py's own decoder."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from gguf_arch.errors import CheckpointError
from gguf_arch.arch.mxfp4 import E2M1, dequantize_compressed, repack_to_ggml


def _random_pair(rng, rows: int, cols: int, scale_lo: int = 0, scale_hi: int = 256):
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scale = rng.integers(scale_lo, scale_hi, (rows, cols // 32), dtype=np.uint8)
    return packed, scale


def _codes(packed: np.ndarray) -> np.ndarray:
    """Natural-order codes, written out element by element (independent of the module)."""
    rows, half = packed.shape
    out = np.zeros((rows, half * 2), dtype=np.uint8)
    for i in range(half):
        out[:, 2 * i] = packed[:, i] & 15
        out[:, 2 * i + 1] = packed[:, i] >> 4
    return out


def _ggml_dequant(packed, scale):
    with np.errstate(over="ignore"):
        return quants.dequantize(repack_to_ggml(packed, scale), GGMLQuantizationType.MXFP4)


@pytest.mark.parametrize("scale_range", [(0, 256), (0, 3), (253, 256), (118, 136)])
def test_repack_bit_exact_against_gguf_py(scale_range):
    rng = np.random.default_rng(sum(scale_range))
    packed, scale = _random_pair(rng, 16, 128, *scale_range)
    ours = dequantize_compressed(packed, scale)
    ggml = _ggml_dequant(packed, scale)
    codes = _codes(packed)
    not_neg_zero = codes != 8
    # Every value is bit-identical except code 8: -0.0 on the HF side, +0.0 in ggml's integer table.
    assert np.array_equal(ours.view(np.uint32)[not_neg_zero], ggml.view(np.uint32)[not_neg_zero])
    assert np.all(ours[~not_neg_zero] == 0) and np.all(ggml[~not_neg_zero] == 0)
    assert np.all(np.signbit(ours[~not_neg_zero]))


def test_code_8_and_scale_extremes_explicitly():
    packed = np.full((1, 16), 0x88, dtype=np.uint8)  # every code 8
    packed[0, 0] = 0x71  # codes 1 (0.5) and 7 (6.0)
    scale = np.array([[0]], dtype=np.uint8)
    out = dequantize_compressed(packed, scale)
    assert out[0, 0] == np.float32(2.0 ** -128)  # subnormal, exact
    assert out[0, 1] == np.float32(6 * 2.0 ** -127)
    assert np.all(out[0, 2:] == 0) and np.all(np.signbit(out[0, 2:]))
    assert np.array_equal(_ggml_dequant(packed, scale)[0, :2], out[0, :2])
    scale[0, 0] = 255
    top = dequantize_compressed(packed, scale)
    assert top[0, 0] == np.float32(2.0 ** 127) and np.isinf(top[0, 1])
    assert np.array_equal(_ggml_dequant(packed, scale)[0, :2], top[0, :2])


def test_dequantize_compressed_matches_the_format_definition():
    rng = np.random.default_rng(3)
    packed, scale = _random_pair(rng, 4, 64, 120, 130)
    codes = _codes(packed)
    want = np.array([[E2M1[codes[r, c]] * 2.0 ** (int(scale[r, c // 32]) - 127) for c in range(64)]
                     for r in range(4)], dtype=np.float32)
    assert np.array_equal(dequantize_compressed(packed, scale), want)


def test_block_layout_is_e_then_low_and_high_halves():
    codes = np.arange(32, dtype=np.uint8) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 16)
    block = repack_to_ggml(packed, np.array([[130]], dtype=np.uint8))[0]
    assert block.size == 17 and block[0] == 130
    assert [int(b) for b in block[1:]] == [int(codes[j] | (codes[j + 16] << 4)) for j in range(16)]


def test_mismatched_pair_is_refused():
    with pytest.raises(CheckpointError, match="do not pair up"):
        repack_to_ggml(np.zeros((4, 32), np.uint8), np.zeros((4, 1), np.uint8))
