"""A GGUF pruned by kimi-k3-prune runs in llama.cpp as it runs in our graph.

On the all-F32 --no-dsa GGUF (test_fast_path_f32.py: both runtimes compute the same thing up to
fp32 summation order and the F16 latent cache), pruned to 5 of 8 experts per layer: llama.cpp
loads it with expert_count 5 and its logits agree with our fast path's within that test's bound.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ggml_graph_spec.tools.prune import main as prune
from ggml_graph_spec.engine.model import Model

from .conftest import _convert, llama_run, requires_llama_cpp
from .test_fast_path_f32 import FAST_F32_REL_TOL
from .test_llama_cpp import _rel

pytestmark = requires_llama_cpp


@pytest.fixture(scope="module")
def pruned_f32_gguf(tmp_path_factory, k31pro_tiny_dir) -> Path:
    src = _convert(tmp_path_factory, k31pro_tiny_dir, "k31pro-f32-no-dsa.gguf", "--no-dsa", "--outtype", "f32",
                   "--requantize-experts", "f32")
    plan = src.with_name("plan.json")
    plan.write_text(json.dumps({"layers": {str(l): sorted((l + 3 * i) % 8 for i in range(5)) for l in range(1, 13)}}))
    out = src.with_name("pruned.gguf")
    assert prune([str(src), str(out), "--plan", str(plan), "--quiet"]) == 0
    return out


def test_pruned_gguf_runs_in_llama_cpp_as_in_our_graph(pruned_f32_gguf, tmp_path):
    ids = list(range(20, 60))
    [theirs] = llama_run(pruned_f32_gguf, [("logits", ids)], tmp_path, flash_attn=True)
    m = Model.load(pruned_f32_gguf, n_ctx=128, n_threads=2)
    try:
        assert m.cfg.num_experts == 5
        ours = m.eval(ids)
    finally:
        m.close()
    assert _rel(ours, np.asarray(theirs)) < FAST_F32_REL_TOL
    assert (ours.argmax(1) == np.asarray(theirs).argmax(1)).all()
