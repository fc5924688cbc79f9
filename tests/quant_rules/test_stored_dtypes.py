"""The table's stored dtype per source (docs/reference/tensors.md#byte-accounting): it matches the
fixtures' shard headers, and a listing without shards takes it where config.json's dtype does not
cover the tensor."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from gguf_arch.arch.config import load_config
from gguf_arch.io.safetensors import INDEX_FILE, open_checkpoint
from gguf_arch.arch.tensors import TABLE, plan_tensors
from gguf_arch.convert.listing import listing_resolution
from quant_rules.rules import QuantOptions

from tests.support.real_plan import write_k31pro_plan

# The five families K3 stores in f32 (conv1d q/k/v, A_log, dt_bias, o_norm, e_score_correction_bias).
F32_OUTPUTS = re.compile(r"blk\.\d+\.(ssm_conv1d_[qkv]\.weight|ssm_a|ssm_dt\.bias|ssm_norm\.weight|exp_probs_b\.bias)$")


def _expected_source_type(name: str, declared: str) -> str:
    if F32_OUTPUTS.match(name):
        return "F32"
    return "MXFP4" if name.endswith("_exps.weight") else declared


def test_every_stored_dtype_is_accepted():
    assert all(s.stored in s.dtypes for spec in TABLE for s in spec.sources)


@pytest.mark.parametrize("fixture", ["k3-tiny", "k31pro-tiny"])
def test_stored_dtypes_are_the_fixtures_dtypes(fixture, fixtures_dir):
    model = fixtures_dir / fixture
    cfg = load_config(model)
    with open_checkpoint(model) as ckpt:
        metas = ckpt.metas
    seen = 0
    for pt in plan_tensors(cfg):
        for i, (name, _) in enumerate(pt.sources):
            if name in metas:  # optional sources are absent
                seen += 1
                assert metas[name].dtype == pt.spec.sources[i % len(pt.spec.sources)].stored, name
    assert seen > 900


def test_no_shard_listing_of_the_real_k31pro_plan_shows_the_f32_sources(tmp_path):
    types, source, _ = listing_resolution(write_k31pro_plan(tmp_path), QuantOptions())
    got = {d.name: d.source_type for d in types.decisions}
    assert len(got) == 2669
    assert {n: _expected_source_type(n, "BF16") for n in got} == got
    assert sum(t == "F32" for t in got.values()) == 92 + 69 * 6
    assert got["blk.3.exp_probs_b.bias"] == got["blk.0.ssm_a"] == got["blk.0.ssm_conv1d_q.weight"] == "F32"
    assert source.startswith("source types as config.json declares them (bf16, except the tensors K3 stores in f32")


def test_another_declared_dtype_covers_only_the_bf16_sources(tmp_path, k31pro_tiny_dir):
    config = json.loads((k31pro_tiny_dir / "config.json").read_text())
    config["text_config"]["dtype"] = "float16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(k31pro_tiny_dir / INDEX_FILE, tmp_path / INDEX_FILE)
    types, source, _ = listing_resolution(tmp_path, QuantOptions())
    got = {d.name: d.source_type for d in types.decisions}
    assert {n: _expected_source_type(n, "F16") for n in got} == got
    assert "F32" in got.values() and "F16" in got.values()
    assert source.startswith("source types as config.json declares them (f16,")

