"""The strict config reader on the fixtures, the real K3 config and broken variants."""
from __future__ import annotations

import copy
import json

import pytest

from gguf_arch.arch.config import load_config, parse_config
from gguf_arch.errors import ConfigError


@pytest.fixture(scope="module")
def pro_raw(k31pro_tiny_dir) -> dict:
    return json.loads((k31pro_tiny_dir / "config.json").read_text())


def _edit(raw: dict, fn) -> dict:
    raw = copy.deepcopy(raw)
    fn(raw["text_config"])
    return raw


def test_fixture_values(k31pro_tiny_dir):
    cfg = load_config(k31pro_tiny_dir)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.num_experts) == (64, 13, 912, 8)
    assert cfg.kda.layers == (0, 1, 2, 4, 5, 6, 8, 9, 10)  # 1-based [1,2,3,5,6,7,9,10,11]
    assert cfg.mla_layers == (3, 7, 11, 12)
    assert cfg.indexer.layers == (3, 7, 11, 12) and (cfg.indexer.n_heads, cfg.indexer.head_dim) == (4, 16)
    assert cfg.indexer.top_k == 2048
    assert [cfg.ffn_kind(l) for l in range(3)] == ["dense", "moe", "moe"]
    assert cfg.mxfp4_group_size == 32
    assert cfg.without_indexer().indexer is None


def test_plain_k3_fixture_has_no_indexer(k3_tiny_dir):
    assert load_config(k3_tiny_dir).indexer is None


def test_real_k3_config(reference_dir):
    cfg = parse_config(json.loads((reference_dir / "kimi-k3-config.json").read_text()))
    assert (cfg.num_layers, len(cfg.kda.layers), len(cfg.mla_layers)) == (93, 69, 24)
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_used, cfg.latent_size) == (7168, 896, 16, 3584)
    assert (cfg.kda.num_heads, cfg.kda.head_dim, cfg.context_length) == (96, 128, 1048576)
    assert cfg.moe_layers == tuple(range(1, 93)) and cfg.indexer is None


def test_generation_boilerplate_is_never_read(pro_raw):
    def boiler(t):
        t["top_k"], t["max_length"], t["head_dim"] = 1, 2, 3
    assert parse_config(_edit(pro_raw, boiler)) == parse_config(pro_raw)
    stripped = _edit(pro_raw, lambda t: [t.pop(k, None) for k in ("top_k", "max_length", "head_dim")])
    assert parse_config(stripped) == parse_config(pro_raw)


def test_text_section_alone_is_accepted(pro_raw):
    assert parse_config(copy.deepcopy(pro_raw["text_config"])) == parse_config(pro_raw)


def test_every_missing_field_is_reported_at_once(pro_raw):
    def drop(t):
        del t["kv_lora_rank"], t["num_experts"]
        del t["linear_attn_config"]["head_dim"]
    with pytest.raises(ConfigError) as e:
        parse_config(_edit(pro_raw, drop))
    for field in ("text_config.kv_lora_rank", "text_config.num_experts", "text_config.linear_attn_config.head_dim"):
        assert field in str(e.value)


def test_quantization_config_must_be_inside_text_config(pro_raw):
    raw = _edit(pro_raw, lambda t: t.pop("quantization_config"))
    raw["quantization_config"] = pro_raw["text_config"]["quantization_config"]
    with pytest.raises(ConfigError, match="text_config.quantization_config is missing"):
        parse_config(raw)


def test_layer_lists_are_one_based_and_range_checked(pro_raw):
    def zero_based(t):
        t["linear_attn_config"]["kda_layers"] = [0, 1, 2, 4, 5, 6, 8, 9, 10]
    with pytest.raises(ConfigError, match=r"kda_layers has layer numbers outside 1\.\.13.*\[0\]"):
        parse_config(_edit(pro_raw, zero_based))


def test_a_layer_in_both_or_neither_list_is_refused(pro_raw):
    def both(t):
        t["linear_attn_config"]["kda_layers"] = [1, 2, 3, 4, 5, 6, 7, 9, 10, 11]
    with pytest.raises(ConfigError, match=r"layers \[4\] are in both"):
        parse_config(_edit(pro_raw, both))


def test_index_layers_must_equal_full_attn_layers(pro_raw):
    with pytest.raises(ConfigError, match=r"only in index_layers: \[5\], only in full_attn_layers: \[4\]"):
        parse_config(_edit(pro_raw, lambda t: t.__setitem__("index_layers", [5, 8, 12, 13])))


def test_index_fields_come_together(pro_raw):
    with pytest.raises(ConfigError, match="index_topk"):
        parse_config(_edit(pro_raw, lambda t: t.pop("index_topk")))


def test_index_topk_must_be_positive(pro_raw):
    with pytest.raises(ConfigError, match="index_topk must be an integer >= 1"):
        parse_config(_edit(pro_raw, lambda t: t.__setitem__("index_topk", 0)))


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_act", "silu", "hidden_act must be 'situ'"),
    ("hidden_size", "64", "hidden_size must be an integer in 0..4294967295"),
    ("num_experts_per_token", 9, "exceeds num_experts"),
])
def test_wrong_values_are_refused(pro_raw, field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(_edit(pro_raw, lambda t: t.__setitem__(field, value)))


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_config(tmp_path)
