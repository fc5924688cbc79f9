"""kimi-k3-diff's bounds for trunk tensors quantized to Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4.

A conversion with `--tensor-type` rules to each type is within bound and passes `--verify`;
gguf-py's quantizers (byte-identical to ggml's) always land within the bound; and a code moved by
one quantization step is caught, in a converted GGUF and on random blocks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from hypothesis import example, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import convert_kimi_k3
from gguf_arch.verify.bounds import BOUNDS
from gguf_arch.verify.diff import MISMATCH, WITHIN_BOUND, diff_gguf

from tests.support.gguf_edit import rewritten_copy, tensor_info

TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4)
# attn_q.weight rows are 64 long, ffn_down.weight 128, ffn_down_shexp 64: whole 32-blocks, no fallback.
RULES = ("attn_q", "ffn_down")

# ---- the codes inside a block ----------------------------------------------------------------

# bytes before the packed 4-bit codes (f16 scale, f16 min, MXFP4's E8M0 byte), and whether 4 bytes
# of fifth bits follow them (Q5_*). A block's codes: element j < 16 in the low nibble of byte j,
# element j + 16 in its high nibble; the fifth bit of element j is bit j of the little-endian 32 bits.
_LAYOUT = {Q.Q4_0: (2, False), Q.Q4_1: (4, False), Q.Q5_0: (2, True), Q.Q5_1: (4, True), Q.MXFP4: (1, False)}


def codes(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """uint8 [blocks, block bytes] -> int [blocks, 32] codes."""
    head, fifth = _LAYOUT[qtype]
    nibbles = raw[:, head + 4 * fifth:]
    c = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int32)
    if fifth:
        c |= np.unpackbits(raw[:, head:head + 4], axis=1, bitorder="little").astype(np.int32) << 4
    return c


def with_codes(raw: np.ndarray, qtype: Q, c: np.ndarray) -> np.ndarray:
    head, fifth = _LAYOUT[qtype]
    out = raw.copy()
    out[:, head + 4 * fifth:] = ((c[:, :16] & 0x0F) | ((c[:, 16:] & 0x0F) << 4)).astype(np.uint8)
    if fifth:
        out[:, head:head + 4] = np.packbits(((c >> 4) & 1).astype(np.uint8), axis=1, bitorder="little")
    return out


# Levels: the codes in the order of the values they stand for. Q*: the code itself (the value is
# q * d + m, or (q - 8|16) * d, monotonic). MXFP4: E2M1 codes 0-7 are +0 .. +6, 8-15 -0 .. -6, so
# the signed order -6 .. -0.5, 0, 0.5 .. 6 has 15 levels, +0 and -0 both level 7.
def n_levels(qtype: Q) -> int:
    return 15 if qtype == Q.MXFP4 else (32 if _LAYOUT[qtype][1] else 16)


def to_level(c: np.ndarray, qtype: Q) -> np.ndarray:
    return np.where(c < 8, 7 + c, 15 - c) if qtype == Q.MXFP4 else c


def from_level(level: np.ndarray, qtype: Q) -> np.ndarray:
    return np.where(level >= 7, level - 7, 15 - level) if qtype == Q.MXFP4 else level


def stepped(raw: np.ndarray, qtype: Q, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Every code moved `step` levels at once (each value depends only on its own code and its
    block's scale, so this is every single-code change side by side): (values, which moved)."""
    level = to_level(codes(raw, qtype), qtype) + step
    valid = (level >= 0) & (level < n_levels(qtype))
    moved = with_codes(raw, qtype, from_level(np.clip(level, 0, n_levels(qtype) - 1), qtype))
    return dequantize(moved, qtype).reshape(-1, 32).astype(np.float64), valid


def blocks_of(x: np.ndarray, qtype: Q) -> np.ndarray:
    with np.errstate(all="ignore"):  # 1 / d overflows for a subnormal d; the f16 scale is 0 then anyway
        return quantize(x.reshape(-1, 32), qtype).reshape(-1, GGML_QUANT_SIZES[qtype][1])


# ---- conversions with --tensor-type rules --------------------------------------------------------

@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def quantized(request, tmp_path_factory, k3_tiny_dir) -> tuple[Q, Path]:
    qtype = request.param
    out = tmp_path_factory.mktemp("quant") / f"{qtype.name}.gguf"
    rules = [arg for pattern in RULES for arg in ("--tensor-type", f"{pattern}={qtype.name.lower()}")]
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(out), "--quiet", *rules]) == 0
    return qtype, out


def test_conversion_is_within_bound_and_verifies(quantized, k3_tiny_dir, capsys):
    qtype, out = quantized
    report = diff_gguf(k3_tiny_dir, out)
    assert report.ok, [t.line() for t in report.tensors if not t.ok]
    trunk = {t.name for t in report.tensors if t.gguf_type == qtype.name and t.table_type != qtype.name}
    assert {"blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.1.ffn_down_shexp.weight"} <= trunk
    assert all(t.status == WITHIN_BOUND for t in report.tensors if t.name in trunk)
    capsys.readouterr()
    assert convert_kimi_k3.main(["--verify", str(out), str(k3_tiny_dir)]) == 0, capsys.readouterr().err


def test_one_code_one_step_off_is_a_mismatch_naming_the_tensor(quantized, k3_tiny_dir, k3_tiny_gguf, tmp_path):
    qtype, out = quantized
    name, (row, col) = "blk.0.attn_q.weight", (3, 37)  # [64, 64]
    raw = np.array(tensor_info(out, name).data).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    block, j = (row * 64 + col) // 32, col % 32
    source_info = tensor_info(k3_tiny_gguf, name)  # the unquantized conversion: the checkpoint's bf16 values
    source = float(dequantize(np.asarray(source_info.data), source_info.tensor_type)[row, col])
    found = float(dequantize(raw, qtype).reshape(-1, 32)[block, j])
    # the one-step move away from the source value (there is one: the code is not at both ends)
    step = next(s for s in (1, -1) if stepped(raw, qtype, s)[1][block, j]
                and (stepped(raw, qtype, s)[0][block, j] - found) * (found - source) >= 0)
    damaged = codes(raw, qtype)
    damaged[block, j] = from_level(to_level(damaged[block, j], qtype) + step, qtype)
    bad = rewritten_copy(out, tmp_path / "bad.gguf", {name: (with_codes(raw, qtype, damaged).reshape(64, -1), qtype)})
    got = {t.name: t for t in diff_gguf(k3_tiny_dir, bad, layers=[0]).tensors}[name]
    assert got.status == MISMATCH and f"beyond the {qtype.name} bound" in got.detail
    assert got.mismatches[0].coords == (row, col) and got.line().startswith(name)


# ---- the bounds against gguf-py's quantizers ------------------------------------------------------

_f32 = dict(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def hard_blocks(draw) -> np.ndarray:
    """Blocks of 32: all zero, constant, random over a huge dynamic range, or a mix of them."""
    n = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(["zero", "constant", "wide", "plain"]), min_size=n, max_size=n))
    out = []
    for kind in kinds:
        if kind == "zero":
            out.append(np.zeros(32, np.float32))
        elif kind == "constant":
            out.append(np.full(32, draw(st.floats(-6e4, 6e4, **_f32).filter(lambda v: v == 0 or abs(v) >= 2 ** -125)),
                               np.float32))
        elif kind == "wide":  # mantissas times powers of two from 2^-60 to 2^12 in one block
            m = draw(hnp.arrays(np.float32, 32, elements=st.floats(-2, 2, **_f32)))
            e = draw(hnp.arrays(np.int32, 32, elements=st.integers(-60, 12)))
            out.append(np.ldexp(m, e).astype(np.float32))
        else:
            out.append(draw(hnp.arrays(np.float32, 32, elements=st.floats(-1e4, 1e4, **_f32))))
    x = np.stack(out)
    # MXFP4's exponent byte cannot express a block max below 2^-125 (see _mxfp4_bound): keep to the format.
    amax = np.abs(x).max(axis=1)
    return x[(amax == 0) | (amax >= 2 ** -125)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(max_examples=150, deadline=None)
@given(x=hard_blocks())
def test_gguf_py_quantizer_lies_within_the_bound(qtype, x):
    if not len(x):
        return
    found = dequantize(blocks_of(x, qtype), qtype).reshape(x.shape)
    err = np.abs(found.astype(np.float64) - x)
    assert (err <= BOUNDS[qtype](x)).all()


@st.composite
def weight_blocks(draw) -> np.ndarray:
    """Blocks as in weights: both signs (|min| within the range), largest magnitude 2^-6 .. 2^4, the
    other 30 values anything up to it, tiny and zero included."""
    rest = draw(hnp.arrays(np.float32, (2, 30), elements=st.floats(-1, 1, **_f32)))
    neg = draw(st.floats(2 ** -7, 1, **_f32))
    scale = np.float32(2.0 ** draw(st.integers(-6, 4)))
    fixed = np.array([[1, -neg]] * 2, np.float32)
    return (np.concatenate([fixed, rest], axis=1) * scale).astype(np.float32)


# Found by this test in CI: values just above an E2M1 magnitude whose spacing below is the smaller
# (u = x / s = 2.0000322: 0.5 below, 1 above), moved one code down.
_JUST_ABOVE_TWO = np.array([[1, -1] + [0.50000805] * 30] * 2, np.float32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(max_examples=100, deadline=None)
@given(x=weight_blocks())
@example(x=_JUST_ABOVE_TWO)
@example(x=np.array([[1.5, -1.5] + [1.00001] * 30] * 2, np.float32))  # u = 4.00004: 1 below, 2 above
def test_a_code_one_step_off_leaves_the_bound(qtype, x):
    """Away from the source: always caught. Towards it: caught unless the source value sat within
    1/20 of a step of the midpoint between the two codes."""
    raw = blocks_of(x, qtype)
    xs = x.astype(np.float64)
    found = dequantize(raw, qtype).reshape(x.shape).astype(np.float64)
    bound = BOUNDS[qtype](x)
    for step in (1, -1):
        moved, valid = stepped(raw, qtype, step)
        size = np.abs(moved - found)
        err = np.abs(moved - xs)
        away = valid & ((moved - found) * (found - xs) >= 0)
        towards = valid & ~away & (np.abs(found - xs) < 0.45 * size)
        assert (err[away] > bound[away]).all()
        assert (err[towards] > bound[towards]).all()


def test_bounds_are_about_half_a_step_on_a_plain_block():
    """-1 .. 7/8: nothing clipped (Q4_0's t = 8x <= 7), so half a step plus the f16 terms (levels *
    2^-11 of a step for the scale, |min| * 2^-11 for the min) and the slack."""
    x = np.linspace(-1, 7 / 8, 32, dtype=np.float32)
    for qtype, step, at_most in ((Q.Q4_0, 1 / 8, 0.505), (Q.Q5_0, 1 / 16, 0.509),
                                 (Q.Q4_1, 1.875 / 15, 0.512), (Q.Q5_1, 1.875 / 31, 0.524)):
        assert (BOUNDS[qtype](x) < at_most * step).all(), qtype.name
    # MXFP4, max 1: scale 2^-2, so grid spacing 0.125 up to |x| = 0.5, then 0.25: half of each.
    assert (BOUNDS[Q.MXFP4](x) <= np.where(np.abs(x) <= 0.5, 0.0625, 0.125) * 1.001).all()


def test_mxfp4_bound_follows_float32_log2_rounding_up():
    """A block max just below 2^10: ggml's float32 log2 rounds to 10, so the shared exponent is the
    next one (grid twice as coarse: 60 rounds to 0, not to 64); the bound allows for both."""
    x = np.zeros(32, np.float32)
    x[0], x[1] = np.nextafter(np.float32(1024), np.float32(0)), 60
    raw = blocks_of(x, Q.MXFP4)
    assert raw[0, 0] == 127 + 10 - 2  # E8M0 byte: exponent floor(log2f(max)) - 2, as rounded
    err = np.abs(dequantize(raw, Q.MXFP4).reshape(32).astype(np.float64) - x)
    assert err[1] == 60 and (err <= BOUNDS[Q.MXFP4](x)).all()
