"""kimi-k3-calibrate --imatrix against llama.cpp's own llama-imatrix: same GGUF, same text, same chunks.

The comparison GGUF is k31pro-tiny converted --no-dsa with every weight in F32 (`--outtype f32
--requantize-experts f32`): no matmul rounds its activations, so both runtimes compute the same
activations up to fp32 summation order and the F16 rounding of the cached MLA latent
(test_fast_path_f32.py), the routing is the same and the per-expert counts are equal.

Bound on in_sum2 (relative to each tensor's largest value): an input computed from the F16 latent
cache can differ by one F16 ulp, 2^-10 relative, when an fp32-level difference moves the rounding
of a cached value; squaring doubles a relative error, so 2 x 2^-10 ~ 2e-3. Everything else differs
by fp32 summation order (measured <= 1.1e-5). Measured on this fixture: 2.6e-4, at the attn_v_b
input of the last MLA layers (the attention output over the F16 cache). A missed token, a head
block out of place or an input of another matmul moves a value by far more than that.

The tools come from scripts/build_llama_tools.sh (tests/interop/llama_tools.py finds them, and
skips these tests with the reason where they are not built).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from ggml_graph_spec.tools.calibrate import main as calibrate
from tests.support.paths import PROSE

from .conftest import _convert
from .llama_tools import run_tool

CHUNK = 64
IMATRIX_REL_TOL = 2 * 2.0 ** -10


@pytest.fixture(scope="module")
def k31pro_f32_no_dsa_gguf(tmp_path_factory, k31pro_tiny_dir) -> Path:
    return _convert(tmp_path_factory, k31pro_tiny_dir, "k31pro-f32-no-dsa.gguf", "--no-dsa", "--outtype", "f32",
                    "--requantize-experts", "f32")


def _both(gguf: Path, tmp_path: Path) -> tuple[GGUFReader, GGUFReader]:
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    # -b = -c: one sequence per batch, as our calibration runs each chunk
    run_tool("llama-imatrix", "-m", gguf, "-f", PROSE, "-o", theirs, "-c", str(CHUNK), "-b", str(CHUNK),
                         "--chunks", "2", "-t", "2", "--no-ppl")
    assert calibrate(["-m", str(gguf), "-f", str(PROSE), "-o", str(tmp_path / "s.json"), "--imatrix", str(ours),
                      "-c", str(CHUNK), "--chunks", "2", "-t", "2"]) == 0
    return GGUFReader(ours), GGUFReader(theirs)


def _fields(r: GGUFReader) -> dict:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _same_layout(ours: GGUFReader, theirs: GGUFReader) -> None:
    assert _fields(ours) == _fields(theirs)
    assert [(t.name, list(t.shape), t.tensor_type) for t in ours.tensors] == \
           [(t.name, list(t.shape), t.tensor_type) for t in theirs.tensors]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), np.finfo(np.float32).tiny))


def test_imatrix_equals_llama_imatrix_on_the_f32_gguf(k31pro_f32_no_dsa_gguf, tmp_path):
    ours, theirs = _both(k31pro_f32_no_dsa_gguf, tmp_path)
    _same_layout(ours, theirs)
    for a, b in zip(ours.tensors, theirs.tensors):
        if a.name.endswith(".counts"):
            np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)
        else:
            assert _rel(a.data, b.data) <= IMATRIX_REL_TOL, a.name


def test_imatrix_layout_equals_llama_imatrix_on_the_mxfp4_gguf(k31pro_no_dsa_gguf, tmp_path):
    """The default GGUF (MXFP4 experts, BF16 matrices): both runtimes round activations inside
    their quantized matmuls (docs/reference/findings.md), so routing drifts apart with depth; the file layout is
    the same, and the first layer's inputs, computed before any such matmul, agree to the bound."""
    ours, theirs = _both(k31pro_no_dsa_gguf, tmp_path)
    _same_layout(ours, theirs)
    first = {"blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts"}
    for a, b in zip(ours.tensors, theirs.tensors):
        if a.name in first:
            assert _rel(a.data, b.data) <= IMATRIX_REL_TOL, a.name


def test_llama_quantize_reads_our_imatrix(k31pro_no_dsa_gguf, tmp_path):
    im = tmp_path / "im.gguf"
    assert calibrate(["-m", str(k31pro_no_dsa_gguf), "-f", str(PROSE), "-o", str(tmp_path / "s.json"),
                      "--imatrix", str(im), "-c", str(CHUNK), "--chunks", "2", "-t", "2"]) == 0
    n = len(GGUFReader(im).tensors) // 2
    r = run_tool("llama-quantize", "--allow-requantize", "--imatrix", im, k31pro_no_dsa_gguf,
                             tmp_path / "q.gguf", "Q4_0", "2")
    assert f"loaded {n} importance matrix entries" in r.stdout + r.stderr
