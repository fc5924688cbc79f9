"""Error bounds of the GGML types a quantized conversion may write, per value of the source.

`BOUNDS[type](x)` is, for float64 source values x (a whole tensor, rows of whole blocks), the
largest |dequantized - x| that type's reference quantizer can produce: the tensor diff accepts a
non-exact type only within it (`diff.py`, verdict `within_bound`). Each bound is derived in its
docstring or comment; tests/gguf_arch/verify/test_bounds.py checks them against gguf-py's
quantizers and shows that one quantization step off is caught.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

# Every type bounded here quantizes blocks of the same 32 values (ggml's QK8_0, QK4_0 ... QK_MXFP4).
_BLOCK = GGML_QUANT_SIZES[Q.Q8_0][0]

def f32_bound(x: np.ndarray) -> np.ndarray:
    return np.zeros_like(x)  # every source (bf16, f16, f32) widens to float32 exactly


def f16_bound(x: np.ndarray) -> np.ndarray:
    # round to nearest: half an ulp, 2^-11 relative for normals, 2^-25 absolute in the subnormals.
    return np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -25)


def bf16_bound(x: np.ndarray) -> np.ndarray:
    # round to nearest with 8 significant bits: half an ulp <= 2^-8 relative (2^-134 subnormal).
    return np.maximum(np.abs(x) * 2.0 ** -8, 2.0 ** -134)


def q8_0_bound(x: np.ndarray) -> np.ndarray:
    # Q8_0 (ggml quantize_row_q8_0): per 32-block d = max|x| / 127, q = round(x / d), stored q * f16(d).
    # |err| <= d/2 (rounding q) + 127 * |f16(d) - d|, with |f16(d) - d| <= max(d * 2^-11, 2^-25)
    # (f16 rounding, normal / subnormal); 2^-16 relative slack covers the float32 x * (1/d).
    blocks = np.abs(_blocks(x))
    d = blocks.max(axis=1, keepdims=True) / 127
    bound = (d / 2 + 127 * np.maximum(d * 2.0 ** -11, 2.0 ** -25)) * (1 + 2.0 ** -16)
    return np.broadcast_to(bound, blocks.shape).reshape(x.shape)


# The 4- and 5-bit types and MXFP4 below, as ggml's reference quantizers (quantize_row_*_ref, which
# gguf-py's quants reproduce byte for byte) choose them, per block of 32 values. Each bound is half
# a quantization step where the code is rounded to nearest (MXFP4's uneven grid: the exact distance
# to the nearest code), the clipped distance where ggml clips, plus the f16 rounding of the stored
# scale / min, plus _STEP_SLACK of a step for the quantizer's float32 arithmetic (x * (1/d)
# rounded can pick the farther of two codes by ~2^-18 of a step).
# Where a step is resolvable (the f16 scale is normal and, for Q4_1/Q5_1, |min| is at most the block's
# range, as in weight blocks that straddle zero; MXFP4 always), a code one step away from the source
# value is caught (its error is a step plus the rounding error), and one step towards it unless the
# value sat within a few hundredths of a step of a rounding midpoint, where either code is as good.
# The f16 terms assume |scale|, |min| <= 65504 (an overflowed f16 is inf: caught).
_STEP_SLACK = 2.0 ** -12


def _blocks(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64).reshape(-1, _BLOCK)


def symmetric_bound(levels: int) -> Callable[[np.ndarray], np.ndarray]:
    """Q4_0 (levels 8), Q5_0 (16): d = m / -levels with m the block's value of largest magnitude
    (the first such), code q = trunc(x / d + levels + 0.5) clipped to [0, 2 levels - 1], stored
    (q - levels) * f16(d). With t = x / d in [-levels, levels] the code q - levels is t rounded to
    nearest, except that t > levels - 1/2 (only values of the opposite sign to m) is clipped to
    levels - 1: |err| <= |d| * max(1/2, t - (levels - 1)) + levels * |f16(d) - d|."""
    def bound(x: np.ndarray) -> np.ndarray:
        blocks = _blocks(x)
        m = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        step = np.abs(m) / levels
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(m == 0, 0.0, -levels * blocks / m)
        rounding = step * (np.maximum(0.5, t - (levels - 1)) + _STEP_SLACK)
        return (rounding + levels * f16_bound(step)).reshape(x.shape)
    return bound


def offset_bound(levels: int) -> Callable[[np.ndarray], np.ndarray]:
    """Q4_1 (levels 15), Q5_1 (31): d = (max - min) / levels, q = round((x - min) / d) in
    [0, levels] (never clipped), stored q * f16(d) + f16(min):
    |err| <= d/2 + levels * |f16(d) - d| + |f16(min) - min|. (A block far from zero, |min| >> max - min,
    is as coarse as f16(min): that is the format's limit, and the bound says so.)"""
    def bound(x: np.ndarray) -> np.ndarray:
        blocks = _blocks(x)
        low = blocks.min(axis=1, keepdims=True)
        step = (blocks.max(axis=1, keepdims=True) - low) / levels
        per_block = step * (0.5 + _STEP_SLACK) + levels * f16_bound(step) + f16_bound(low)
        return np.broadcast_to(per_block, blocks.shape).reshape(x.shape)
    return bound


def _e2m1_rounding(u: np.ndarray) -> np.ndarray:
    """The distance from u >= 0 to the E2M1 magnitude nearest it (0, .5 .. 2 step .5, 3, 4, 6;
    above 6 the clipped u - 6). Exact, not the local half-spacing: at a magnitude whose spacing
    differs on its two sides (2: 0.5 below, 1 above; 4: 1 and 2), u just above it moved one code
    down is off by little more than the smaller spacing, which half the larger would let pass."""
    return np.select([u <= 2, u <= 4, u <= 6], [np.abs(u - np.rint(2 * u) / 2), np.abs(u - np.rint(u)),
                                                np.minimum(u - 4, 6 - u)], u - 6)


def mxfp4_bound(x: np.ndarray) -> np.ndarray:
    """MXFP4 (ggml quantize_row_mxfp4_ref): the E8M0 shared exponent gives the scale
    s = 2^(floor(log2 max|x|) - 2), so max|x| / s is in [4, 8); each value is the E2M1 code nearest x / s
    (magnitudes up to 6, so the block's largest values are clipped by up to 2 s), stored exactly
    as E2M1 * s: no scale rounding. |err| <= s * _e2m1_rounding(|x| / s).

    ggml takes floor(log2f(max)) in float32, which rounds a max just below a power of two (within
    half a float32 ulp of log2: at most ~2^-18 relative) up to it and so uses the next exponent;
    blocks whose max is within 2^-14 below a power of two get the larger of both bounds. The bound
    assumes max|x| is 0 or at least 2^-125: below that ggml's exponent byte wraps around."""
    blocks = np.abs(_blocks(x))
    amax = blocks.max(axis=1, keepdims=True)
    _, exp = np.frexp(amax)  # amax = f * 2^exp, f in [0.5, 1): floor(log2 amax) = exp - 1
    scale = np.ldexp(1.0, exp - 3)
    bound = scale * (_e2m1_rounding(blocks / scale) + _STEP_SLACK)
    rounded_up = amax >= np.ldexp(1 - 2.0 ** -14, exp)
    bound = np.where(rounded_up, np.maximum(bound, 2 * scale * (_e2m1_rounding(blocks / (2 * scale)) + _STEP_SLACK)),
                     bound)
    return np.where(amax > 0, bound, 0.0).reshape(x.shape)


BOUNDS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: f32_bound, Q.F16: f16_bound, Q.BF16: bf16_bound, Q.Q8_0: q8_0_bound,
    Q.Q4_0: symmetric_bound(8), Q.Q5_0: symmetric_bound(16),
    Q.Q4_1: offset_bound(15), Q.Q5_1: offset_bound(31), Q.MXFP4: mxfp4_bound,
}
