"""The real K3.1-Pro plan without weights: the reference K3 config and index plus the K3.1-Pro
indexer fields and tensors (docs/reference/config.md, docs/reference/tensors.md#indexer-tensors)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from tests.support.paths import REFERENCE

INDEXER_TENSORS = ("wq_b.weight", "wk.weight", "k_norm.weight", "weights_proj.weight")


def write_k31pro_plan(out: Path) -> Path:
    """config.json + model.safetensors.index.json of K3.1-Pro in `out` (no shards)."""
    config = json.loads((REFERENCE / "kimi-k3-config.json").read_text())
    text = config["text_config"]
    full = text["linear_attn_config"]["full_attn_layers"]
    text.update(index_n_heads=32, index_head_dim=128, index_topk=2048, index_layers=list(full))
    with gzip.open(REFERENCE / "kimi-k3-model.safetensors.index.json.gz", "rt") as f:
        index = json.load(f)
    wmap = index["weight_map"]
    for layer in full:
        prefix = f"language_model.model.layers.{layer - 1}.self_attn."
        shard = wmap[prefix + "o_proj.weight"]
        for name in INDEXER_TENSORS:
            wmap[prefix + "indexer." + name] = shard
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out
