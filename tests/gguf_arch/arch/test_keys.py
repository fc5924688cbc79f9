"""The GGUF key table drives both sides: `model_keys` writes a config, `config_from_metadata`
reads the same config back from those keys, every K3Config field coming from one place."""
from __future__ import annotations

import json

import pytest

from gguf_arch.arch import keys as K
from gguf_arch.arch.config import K3Config, load_config, parse_config
from gguf_arch.arch.config_fields import FIELDS, INDEX_FIELDS
from gguf_arch.errors import GGUFError

from tests.support.paths import K3_TINY, K31PRO_TINY, REFERENCE


def _configs() -> list[K3Config]:
    real = parse_config(json.loads((REFERENCE / "kimi-k3-config.json").read_text()))
    return [load_config(K3_TINY), load_config(K31PRO_TINY), real]


def _metadata(cfg: K3Config) -> dict:
    meta = {key: value for key, value, _type, _sub in K.model_keys(cfg)}
    meta["general.architecture"] = K.ARCH
    meta.update({key: getattr(cfg, field) for field, key in K.TOKEN_ID_KEYS.items()})
    return meta


@pytest.mark.parametrize("cfg", _configs(), ids=["k3-tiny", "k31pro-tiny", "real-k3"])
def test_the_reader_rebuilds_what_the_writer_wrote(cfg):
    assert K.config_from_metadata(_metadata(cfg), "test") == cfg


def test_every_config_field_has_one_source_in_a_gguf():
    """Each field of config.json's table (and each indexer field) is held by exactly one key, or
    is one of the few the GGUF does not store, or a tokenizer id: never two of these."""
    held = [f for k in K.ARCH_KEYS + K.DSA_KEYS for f in k.fields_held]
    assert len(held) == len(set(held)), sorted(f for f in held if held.count(f) > 1)
    elsewhere = K.NOT_STORED.keys() | K.TOKEN_ID_KEYS.keys()
    assert not set(held) & elsewhere
    wanted = {f.attr for f in FIELDS + INDEX_FIELDS if f.attr} | {"mxfp4_group_size"}
    assert wanted == set(held) | elsewhere


def test_indexer_key_names_are_the_table_rows():
    assert K.INDEXER_KEYS == tuple(k.full_name for k in K.DSA_KEYS)
    assert K.INDEXER_TOP_K == f"{K.ARCH}.attention.indexer.top_k"


_RANGED = {f.attr for f in FIELDS if f.rule is not None}


@pytest.mark.parametrize("key", [k for k in K.ARCH_KEYS + K.DSA_KEYS if k.field in _RANGED], ids=lambda k: k.name)
def test_every_ranged_field_is_checked_when_read(key):
    """Zero in a key whose field the config reader ranges (>= 1, > 0) is refused on reading too:
    one table of ranges for both readers."""
    meta = _metadata(load_config(K31PRO_TINY))
    meta[key.full_name] = 0.0 if key.vtype == K.T.FLOAT32 else 0
    with pytest.raises(GGUFError, match="kimi-k3"):
        K.config_from_metadata(meta, "test")


def test_a_range_problem_names_the_gguf_key():
    meta = _metadata(load_config(K31PRO_TINY))
    meta[f"{K.ARCH}.attn_res.block_size"] = 0  # no derived key reads it: only the range catches it
    with pytest.raises(GGUFError, match=r"kimi-k3\.attn_res\.block_size must be >= 1, got 0"):
        K.config_from_metadata(meta, "test")
