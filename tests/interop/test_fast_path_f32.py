"""Our FAST path against llama.cpp with flash attention on, on the all-F32 GGUF (`--outtype f32
--requantize-experts f32`): both run F32 weights (nothing to round activations to inside a
matmul), an F16 latent cache and flash attention. Our fast path builds llama.cpp's graph where the
last bit depends on it (test_llama_cpp.py lists what), so the logits are the same bit for bit,
given ggml builds of the same CPU features. F32 weights take two matmul paths the MXFP4 GGUF's
BF16 ones do not: ggml multiplies an F32 weight with a non-contiguous activation (attn_k_b,
attn_v_b: llama.cpp passes permuted views) in another summation order than a contiguous one, so
copying those views first moved the logits by 3e-5 relative.
"""
from __future__ import annotations

import numpy as np
import pytest

from ggml_graph_spec.model import Model

from .conftest import llama_run, requires_llama_cpp
from .test_llama_cpp import PROMPTS, _ids, _rel

pytestmark = requires_llama_cpp


@pytest.fixture(scope="module")
def k3_ref(k3_tiny_dir):
    return np.load(k3_tiny_dir / "reference.npz")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fast_path_on_f32_gguf_equals_llama_cpp(k3_f32_gguf, k3_ref, tmp_path, llama_kernels, prompt):
    llama_kernels.skip_unless_same()
    ids = _ids(k3_ref, prompt)
    [theirs] = llama_run(k3_f32_gguf, [("logits", ids)], tmp_path, flash_attn=True)
    m = Model.load(k3_f32_gguf, n_ctx=128, n_threads=2)
    try:
        ours = m.eval(ids)
    finally:
        m.close()
    assert np.array_equal(ours, theirs), _rel(ours, theirs)
