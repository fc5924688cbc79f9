"""Every tier of the tier table in docs/bench/tiers.md (bench/results/tiers.json, written by
bench/tiers.py) is made again here with the bench's own recipe and loads and runs in our graph,
fast and exact path, and in llama-cli. The tiers are every type kimi-k3-quantize offers, so this is also the
proof that the graph runs every type that tool writes.

The importance matrix here covers two chunks of the calibration text, not the bench's six: what
it holds changes the quantized values, not the file's layout, so each tier's tensor data is as
large as the table's to the byte (the file itself is not: llama-quantize records the imatrix's
path and chunk count in the metadata).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from bench.tiers import (RESULTS, TIER_MODEL, TIERS, expert_bits, make_imatrix, make_model, make_tier,
                         tensor_bytes, tier_name)
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.text.tokenizer import BPETokenizer
from quant_rules import llama_quantize
from quant_rules.llama_types import LLAMA_QUANTIZE_TYPES

from .llama_tools import llama_bin, llama_cli

TABLE = json.loads(RESULTS.read_text(encoding="utf-8"))
PROMPT = "[BOS]The lighthouse keeper woke before dawn"


def test_the_table_is_the_recipes_tiers_and_covers_every_offered_type():
    assert TABLE["model"]["synth"] == TIER_MODEL
    rows = TABLE["rows"]
    assert rows[0]["type"] == "mxfp4" and rows[0]["kl_mean"] == 0.0  # the original, against itself
    assert [r["tier"] for r in rows[1:]] == [tier_name(t, im) for t, im in TIERS]
    assert {t for t, _ in TIERS} == set(LLAMA_QUANTIZE_TYPES)


@pytest.fixture(scope="module")
def tier_inputs(tmp_path_factory):
    llama_bin()  # fails under CI=true, skips otherwise, when the tools are not built
    d = tmp_path_factory.mktemp("tiers")
    original = make_model(d)
    return d, original, make_imatrix(original, d, chunks=2)


@pytest.mark.parametrize("row", TABLE["rows"][1:], ids=lambda r: r["tier"])
def test_tier_loads_and_runs_in_our_graph_and_in_llama_cli(row, tier_inputs, tmp_path, monkeypatch):
    monkeypatch.setenv(llama_quantize.LLAMA_BIN_ENV, str(llama_bin()))
    d, original, imatrix = tier_inputs
    t = Q[row["type"].upper()]
    gguf = make_tier(original, t, imatrix if row["imatrix"] else None, d)
    assert tensor_bytes(gguf) == row["tensor_bytes"]
    assert expert_bits(gguf) == row["expert_bits_per_weight"]
    ids = BPETokenizer.from_gguf(gguf).encode(PROMPT)
    for exact in (False, True):
        m = Model.load(gguf, n_ctx=64, exact_experts=exact, n_threads=2)
        try:
            assert np.isfinite(m.eval(ids)).all()
        finally:
            m.close()
    llama_cli(gguf, PROMPT, 8, tmp_path, "-c", "64")  # loads, generates, exits 0
