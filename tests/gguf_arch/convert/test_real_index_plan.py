"""Plan the conversion of the real Kimi K3 index (497,220 names) without any weights.

Shapes come from the tensor table for the real config; dtypes follow
docs/reference/tensors.md#byte-accounting (five f32 families, uint8 experts, bf16 otherwise). The
byte accounting against the index's total_size then checks the table's shapes independently of the
planner.
"""
from __future__ import annotations

import copy
import gzip
import json
import math

import pytest

from gguf_arch.arch.config import parse_config
from gguf_arch.convert.plan import plan_conversion
from gguf_arch.io.safetensors import TensorMeta
from gguf_arch.arch.tensors import TEXT_PREFIX, U8, plan_tensors

F32_SUFFIXES = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")
INDEXER = {"wq_b.weight": lambda c: [c.indexer.n_heads * c.indexer.head_dim, c.q_lora_rank],
           "wk.weight": lambda c: [c.indexer.head_dim, c.hidden_size],
           "k_norm.weight": lambda c: [c.indexer.head_dim],
           "weights_proj.weight": lambda c: [c.indexer.n_heads, c.hidden_size]}


def _vision_bytes() -> int:
    """docs/reference/tensors.md#vision-and-projector-names: every vision / projector tensor, bf16."""
    block = 4608 * 1024 + 1024 * 1536 + 4096 * 1024 + 1024 * 4096 + 1024 + 1024
    elements = (1024 * 3 * 14 * 14 + 64 * 64 * 1024 + 27 * block + 1024
                + 4096 * 4096 + 7168 * 4096 + 7168)
    return 2 * elements


@pytest.fixture(scope="module")
def real(reference_dir):
    raw = json.loads((reference_dir / "kimi-k3-config.json").read_text())
    with gzip.open(reference_dir / "kimi-k3-model.safetensors.index.json.gz") as f:
        index = json.load(f)
    return raw, index


def _synthesize(cfg, names) -> dict[str, TensorMeta]:
    """A meta for every index name: the table's shape for text tensors, a placeholder for vision."""
    shapes = {}
    for pt in plan_tensors(cfg):
        for i, (name, shape) in enumerate(pt.sources):
            dtypes = pt.spec.sources[i % len(pt.spec.sources)].dtypes
            dtype = "U8" if dtypes == U8 else "F32" if name.endswith(F32_SUFFIXES) else "BF16"
            shapes[name] = TensorMeta(dtype, shape)
    return {n: shapes.get(n, TensorMeta("BF16", (1,))) for n in names}


def _nbytes(meta: TensorMeta) -> int:
    return math.prod(meta.shape) * (1 if meta.dtype == "U8" else 4 if meta.dtype == "F32" else 2)


@pytest.fixture(scope="module")
def k3(real):
    raw, index = real
    cfg = parse_config(raw)
    return cfg, _synthesize(cfg, list(index["weight_map"]))


def test_real_k3_index_is_fully_accounted_for(real, k3):
    cfg, metas = k3
    assert len(metas) == 497_220
    ledger = plan_conversion(cfg, metas).ledger
    assert (ledger.consumed, ledger.skipped, ledger.written) == (497_220 - 168, 168, 2573)
    text_bytes = sum(_nbytes(m) for n, m in metas.items() if n.startswith(TEXT_PREFIX))
    assert text_bytes + _vision_bytes() == real[1]["metadata"]["total_size"] == 1_560_860_324_864


@pytest.fixture(scope="module")
def pro(real, k3):
    """K3.1-Pro per the contract: the index_* fields and 4 indexer tensors per full-attention layer."""
    raw = copy.deepcopy(real[0])
    text = raw["text_config"]
    layers = text["linear_attn_config"]["full_attn_layers"]
    text.update(index_n_heads=32, index_head_dim=128, index_topk=2048, index_layers=list(layers))
    cfg = parse_config(raw)
    metas = dict(k3[1])
    metas.update({f"{TEXT_PREFIX}model.layers.{l - 1}.self_attn.indexer.{suffix}": TensorMeta("BF16", tuple(shape(cfg)))
                  for l in layers for suffix, shape in INDEXER.items()})
    return cfg, metas


def test_real_k31pro_index_is_fully_accounted_for(pro):
    cfg, metas = pro
    assert len(cfg.indexer.layers) == 24 and len(metas) == 497_220 + 96
    plan = plan_conversion(cfg, metas)
    assert (plan.ledger.consumed, plan.ledger.skipped, plan.ledger.written) == (497_220 - 168 + 96, 168, 2573 + 96)
    indexer = [o.output for o in plan.outputs if ".indexer." in o.output.name]
    assert len(indexer) == 96
    assert {o.name.split(".")[3] for o in indexer} == {"attn_q_b", "attn_k", "proj", "k_norm"}


def test_real_k31pro_index_without_dsa(pro):
    cfg, metas = pro
    ledger = plan_conversion(cfg, metas, dsa=False).ledger
    assert (ledger.consumed, ledger.skipped, ledger.written) == (497_220 - 168, 168 + 96, 2573)
