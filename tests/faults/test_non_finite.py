"""Non-finite values never pass silently (gguf_arch/convert/finite.py): a NaN or inf the converter
would write is refused with one line naming the tensor and the first bad element (exit 2, nothing
under OUT); --allow-non-finite writes it with one warning line per tensor, and then --verify of
that output passes: the converter and its verifier never disagree. Child processes throughout."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gguf import GGMLQuantizationType as Q

from gguf_arch.io.nonfinite import NonFiniteScan
from gguf_arch.io.output_paths import manifest_path, partial_path
from tests.fuzz.harness import FUZZ
from tests.support.checkpoint_edit import EditableCheckpoint, source_array
from tests.support.cli import run_cli
from tests.support.paths import FIXTURES

K3_TINY = FIXTURES / "k3-tiny"
L = "language_model.model.layers."


def _bf16(x: np.ndarray) -> bytes:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


def _poke(ckpt: EditableCheckpoint, name: str, index: int, value: float | int) -> None:
    """Set element `index` of a tensor (bf16/f32 by value, u8 by byte)."""
    dtype, a = source_array(ckpt.dir, name)
    flat = a.reshape(-1).copy()
    if dtype == "BF16":
        flat[index] = np.frombuffer(_bf16(np.array([value])), "<u2")[0]
    else:
        flat[index] = value
    ckpt.replace(name, dtype, list(a.shape), flat.tobytes())


CASES = {
    # (tensor, element, value, extra args, GGUF tensor named in the line)
    "nan-in-bf16": (L + "3.self_attn.q_a_proj.weight", 5, float("nan"), (), "blk.3.attn_q_a.weight"),
    "inf-in-f32": (L + "1.block_sparse_moe.gate.e_score_correction_bias", 2, float("inf"), (),
                   "blk.1.exp_probs_b.bias"),
    "e8m0-nan-scale": (L + "1.block_sparse_moe.experts.0.w1.weight_scale", 0, 0xFF, (),
                       "blk.1.ffn_gate_exps.weight"),
    "f16-overflow": (L + "3.self_attn.q_a_proj.weight", 7, 1e10, ("--outtype", "f16"), "blk.3.attn_q_a.weight"),
    "a-log-exp-overflow": (L + "0.self_attn.A_log", 0, 100.0, (), "blk.0.ssm_a"),
}


@pytest.fixture(params=CASES)
def broken(request, tmp_path):
    name, index, value, extra, gguf_name = CASES[request.param]
    ckpt = EditableCheckpoint(K3_TINY, tmp_path / "model")
    _poke(ckpt, name, index, value)
    return ckpt.dir, extra, gguf_name, request.param


def test_refused_with_one_line_naming_tensor_and_element(broken, tmp_path):
    model, extra, gguf_name, case = broken
    out = tmp_path / "o.gguf"
    res = run_cli(model, out, "--quiet", *extra)
    err = res.one_error_line(2, gguf_name, "is not finite", "--allow-non-finite")
    assert "RuntimeWarning" not in err
    assert not out.exists() and not partial_path(out).exists() and not manifest_path(out).exists()


def test_allowed_with_one_warning_and_verify_agrees(broken, tmp_path):
    model, extra, gguf_name, case = broken
    out = tmp_path / "o.gguf"
    res = run_cli(model, out, "--quiet", "--allow-non-finite", *extra)
    assert res.rc == 0, res.err
    warnings = [line for line in res.err.splitlines() if line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and gguf_name in warnings[0], res.err
    verified = run_cli("--verify", out, model, "--quiet")
    assert verified.rc == 0, verified.err


# ---- the scan itself, against a decoder: any bytes, any chunking --------------------------

def _decoded_bad(qtype: Q, data: bytes) -> np.ndarray:
    """Non-finite per element, by gguf-py's own dequantizer (E8M0 0xFF counts as NaN)."""
    from gguf.quants import dequantize
    from gguf.constants import GGML_QUANT_SIZES
    raw = np.frombuffer(data, dtype=np.uint8)
    elems, size = GGML_QUANT_SIZES[qtype]
    with np.errstate(over="ignore", invalid="ignore"):
        values = dequantize(raw.reshape(-1, size), qtype).reshape(-1)
    bad = ~np.isfinite(values)
    if qtype == Q.MXFP4:
        bad |= np.repeat(raw.reshape(-1, size)[:, 0] == 0xFF, elems)
    return bad


TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4]


@FUZZ
@given(qtype=st.sampled_from(TYPES), data=st.data())
def test_fuzz_scan_finds_the_first_non_finite_element(qtype, data):
    from gguf.constants import GGML_QUANT_SIZES
    elems, size = GGML_QUANT_SIZES[qtype]
    n_units = data.draw(st.integers(1, 12))
    blob = data.draw(st.binary(min_size=n_units * size, max_size=n_units * size))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=4)))
    scan = NonFiniteScan(qtype)
    for a, b in zip([0, *cuts], [*cuts, len(blob)]):
        scan.feed(blob[a:b])
    bad = _decoded_bad(qtype, blob)
    per_unit = bad.reshape(-1, elems).any(axis=1)
    if elems == 1:
        assert scan.first == (int(np.argmax(bad)) if bad.any() else None)
    else:  # a non-finite scale makes its whole block non-finite; a finite one cannot
        assert (scan.first is None) == (not per_unit.any())
        if per_unit.any():
            assert scan.first == int(np.argmax(per_unit)) * elems
    assert scan.bad_units == int(per_unit.sum())


# Bit patterns of the largest finite value and of the smallest-magnitude non-finite ones (+inf,
# -NaN) of each float type: the edges of the quick pass's masked-max comparison.
_EDGES = {Q.F32: ("<u4", 0x7F7FFFFF, (0x7F800000, 0xFFC00001)), Q.F16: ("<u2", 0x7BFF, (0x7C00, 0xFE01)),
          Q.BF16: ("<u2", 0x7F7F, (0x7F80, 0xFFC1))}


@pytest.mark.parametrize("qtype", list(_EDGES))
def test_one_bad_value_in_a_chunk_of_many_cache_slices(qtype):
    """A chunk of several scan slices (1 MiB and a partial slice), every value the largest finite
    one (or its negative), with one non-finite value placed at a slice's first or last element or
    at the chunk's end: found at its index; none placed: none found."""
    from gguf_arch.io.nonfinite import _SLICE_BYTES
    dtype, finite, bad_values = _EDGES[qtype]
    n = (4 * _SLICE_BYTES + 1000) // np.dtype(dtype).itemsize
    per_slice = _SLICE_BYTES // np.dtype(dtype).itemsize
    values = np.full(n, finite, dtype=dtype)
    values[1::2] |= np.array(0x80000000 if dtype == "<u4" else 0x8000, dtype=dtype)  # negative
    clean = NonFiniteScan(qtype)
    clean.feed(values.tobytes())
    assert clean.first is None and clean.bad_units == 0
    for where in (0, per_slice - 1, per_slice, 3 * per_slice + 7, n - 1):
        for bad in bad_values:
            broken = values.copy()
            broken[where] = bad
            scan = NonFiniteScan(qtype)
            scan.feed(broken.tobytes())
            assert (scan.first, scan.bad_units) == (where, 1), (hex(bad), where)
