"""Re-encoding: gguf-py's quantizers equal ggml's, batching by rows changes no byte, memory stays
flat, and the MXFP4 expert requantization costs what requantize_warning says."""
from __future__ import annotations

import ctypes
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from quant_rules import quantize
from quant_rules.quantize import ErrorMeter, decode_rows, encode_rows, reencode
from quant_rules.rules import WRITABLE_TYPES

ggml = pytest.importorskip("ggml")


def _weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 10, (rows, 1))).astype(np.float32)
    x[1, :40] = 0.0  # an all-zero block
    x[2, 5] = 3e4  # an outlier
    return x


@pytest.mark.parametrize("t", WRITABLE_TYPES, ids=lambda t: t.name)
def test_gguf_py_writes_what_ggml_writes(t):
    """The claim behind WRITABLE_TYPES: byte-identical to ggml_quantize_chunk."""
    x = _weights(16, 256)
    block, size = GGML_QUANT_SIZES[t]
    buf = (ctypes.c_uint8 * (x.size // block * size))()
    ggml.ggml_quantize_chunk(int(t), x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                             ctypes.cast(buf, ctypes.c_void_p), 0, x.shape[0], x.shape[1], None)
    assert encode_rows(x, t).tobytes() == bytes(buf)


def _chunks(raw: bytes, size: int):
    for i in range(0, len(raw), size):
        yield memoryview(raw[i:i + size])


@pytest.mark.parametrize("src, dst", [(Q.BF16, Q.Q8_0), (Q.F32, Q.BF16), (Q.F32, Q.Q4_0), (Q.BF16, Q.F16),
                                      (Q.MXFP4, Q.Q8_0)])
def test_row_batches_and_odd_chunks_change_no_byte(monkeypatch, src, dst):
    x = _weights(37, 128, seed=1)
    raw = encode_rows(x, src).tobytes()
    whole = encode_rows(decode_rows(src, np.frombuffer(raw, np.uint8), 128), dst).tobytes()
    monkeypatch.setattr(quantize, "BATCH_VALUES", 3 * 128)  # 3 rows per batch
    got = b"".join(bytes(c) for c in reencode(_chunks(raw, 1000), src, dst, 128))
    assert got == whole


def test_a_partial_trailing_row_is_an_error():
    with pytest.raises(ValueError, match="trailing bytes"):
        list(reencode([b"\0" * 10], Q.F32, Q.F16, 4))


def test_memory_stays_flat_for_a_large_tensor():
    """64 MiB of bf16 rows through Q8_0: the peak is a few batches, not the tensor."""
    rows, cols = 1024, 32768
    row = (np.arange(cols, dtype=np.float32) % 97 - 48).astype(np.float32)
    row_bytes = encode_rows(row[None, :], Q.BF16).tobytes()

    def source():
        for _ in range(rows // 64):
            yield memoryview(row_bytes * 64)  # 4 MiB chunks, made on demand

    tracemalloc.start()
    try:
        n = sum(len(c) for c in reencode(source(), Q.BF16, Q.Q8_0, cols))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == rows * cols // 32 * 34
    assert peak < 48 * 2**20, peak  # the tensor is 64 MiB in, 34 MiB out


def _mxfp4_blocks(scales: np.ndarray) -> tuple[bytes, np.ndarray]:
    """One row per scale byte, every code 0..15 twice; and the exact values E2M1[code] * 2^(e-127)."""
    codes = np.tile(np.arange(16, dtype=np.uint8), 2)
    qs = codes[:16] | (codes[16:] << 4)
    raw = np.concatenate([scales[:, None].astype(np.uint8), np.tile(qs, (len(scales), 1))], axis=1)
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6])
    exact = e2m1[codes][None, :] * np.exp2(scales.astype(np.float64) - 127)[:, None]
    return raw.tobytes(), exact


def _requantized(scales, dst) -> tuple[np.ndarray, np.ndarray]:
    raw, exact = _mxfp4_blocks(np.asarray(scales))
    out = b"".join(bytes(c) for c in reencode([raw], Q.MXFP4, dst, 32))
    return decode_rows(dst, np.frombuffer(out, np.uint8), 32).astype(np.float64), exact


@pytest.mark.parametrize("dst", [Q.F32, Q.BF16])
def test_f32_and_bf16_hold_every_mxfp4_weight_exactly(dst):
    got, exact = _requantized(np.arange(0, 253), dst)
    assert np.array_equal(got, exact)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_f16_is_exact_exactly_for_scale_bytes_104_to_140():
    got, exact = _requantized(np.arange(104, 141), Q.F16)
    assert np.array_equal(got, exact)
    for outside in (103, 141):
        got, exact = _requantized([outside], Q.F16)
        assert not np.array_equal(got, exact)


def test_q8_0_error_is_within_the_stated_bound():
    """Each weight within max|block|/254 plus 127 x the f16 rounding of the block scale d = max/127
    (half an ulp: relative 2^-11, or 2^-25 where d is an f16 subnormal)."""
    scales = np.arange(104, 141)
    got, exact = _requantized(scales, Q.Q8_0)
    amax = np.abs(exact).max(axis=1, keepdims=True)
    bound = amax / 254 + 127 * np.maximum(amax / 127 * 2.0 ** -11, 2.0 ** -25)
    assert np.all(np.abs(got - exact) <= bound)
    assert not np.array_equal(got, exact)


def test_error_meter_reports_the_relative_error():
    meter = ErrorMeter()
    raw, exact = _mxfp4_blocks(np.array([120, 121]))
    list(reencode([raw], Q.MXFP4, Q.Q8_0, 32, meter))
    got, _ = _requantized([120, 121], Q.Q8_0)
    want = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert meter.relative == pytest.approx(want, rel=1e-9)
    assert 0 < meter.relative < 0.01


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 4), chunk=st.integers(1, 5000), batch_rows=st.integers(1, 5),
       src=st.sampled_from([Q.F32, Q.F16, Q.BF16, Q.MXFP4]), dst=st.sampled_from(WRITABLE_TYPES))
def test_any_chunking_gives_the_whole_tensor_bytes(rows, blocks, chunk, batch_rows, src, dst):
    cols = 32 * blocks
    raw = encode_rows(_weights(rows + 3, cols, seed=rows), src).tobytes()  # rows 1-2: zeros, an outlier
    whole = encode_rows(decode_rows(src, np.frombuffer(raw, np.uint8), cols), dst).tobytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quantize, "BATCH_VALUES", batch_rows * cols)
        assert b"".join(bytes(c) for c in reencode(_chunks(raw, chunk), src, dst, cols)) == whole
