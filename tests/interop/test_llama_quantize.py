"""kimi-k3-quantize through the real llama-quantize: the protected set survives it byte for byte
(on a K3.1-Pro GGUF with the DSA indexer, which llama.cpp's own loader cannot run but its
quantizer reads), and the result runs in our graph with DSA on."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

import kimi_k3_quantize
from ggml_graph_spec.engine.model import Model
from quant_rules import llama_quantize
from quant_rules.rules import load_protected_set
from tests.support.generated import ROWS_256, generated_gguf

from .llama_tools import llama_bin


@pytest.fixture(autouse=True)
def _tools():
    llama_bin()  # fails under CI=true, skips otherwise, when the tools are not built


@pytest.fixture(scope="module")
def dsa_gguf(tmp_path_factory):
    """A K3.1-Pro GGUF (indexer kept) whose expert rows fit the 256-wide blocks."""
    return generated_gguf(tmp_path_factory.mktemp("dsa256"), "k31pro", *ROWS_256)


def test_only_the_experts_change_and_the_result_runs_with_dsa(dsa_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv(llama_quantize.LLAMA_BIN_ENV, str(llama_bin()))
    out = tmp_path / "q3k.gguf"
    # A rule aimed at the indexer's key projection is refused (protected), one at the trunk applies.
    assert kimi_k3_quantize.main([str(dsa_gguf), str(out), "q3_k", "--tensor-type", r"indexer\.attn_k=q8_0",
                                "--tensor-type", r"ffn_routed_up=q8_0", "-t", "2"]) == 0
    before = {t.name: t for t in GGUFReader(dsa_gguf).tensors}
    after = {t.name: t for t in GGUFReader(out).tensors}
    assert sorted(after) == sorted(before)  # (llama-quantize moves output.weight to the front)
    experts = next(r for r in load_protected_set().rules if r.experts)
    for name, t in before.items():
        if experts.matches(name):
            assert after[name].tensor_type == Q.Q3_K, name
        elif name.endswith("ffn_routed_up.weight"):
            assert after[name].tensor_type == Q.Q8_0, name
        else:  # protected (indexer, norms, router, AttnRes, KDA vectors) or trunk: untouched
            assert after[name].tensor_type == t.tensor_type, name
            assert after[name].data.tobytes() == t.data.tobytes(), name
    assert sum(".indexer." in n for n in after) == 4  # one DSA layer, 4 indexer tensors
    m = Model.load(out, n_ctx=64, n_threads=2)
    try:
        assert m.cfg.indexer is not None and m.top_k is not None  # DSA runs
        assert np.isfinite(m.eval(list(range(1, 17)))).all()
    finally:
        m.close()
