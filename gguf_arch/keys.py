"""GGUF metadata of the `kimi-k3` architecture (k3-spec E.2) and the K3.1-Pro indexer keys
(contract section 5), as one table that the writer and the graph loader share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gguf import GGUFValueType as T
from gguf import Keys

from .config import K3Config

ARCH = "kimi-k3"
FILE_TYPE_MXFP4_MOE = 38  # llama.cpp's LLAMA_FTYPE_MOSTLY_MXFP4_MOE
QUANTIZATION_VERSION = 2

INDEXER_HEAD_COUNT = f"{ARCH}.attention.indexer.head_count"
INDEXER_KEY_LENGTH = f"{ARCH}.attention.indexer.key_length"
INDEXER_TOP_K = f"{ARCH}.attention.indexer.top_k"
INDEXER_LAYERS = f"{ARCH}.attention.indexer.layers"
INDEXER_KEYS = (INDEXER_HEAD_COUNT, INDEXER_KEY_LENGTH, INDEXER_TOP_K, INDEXER_LAYERS)

# A GGUF made by kimi-k3-prune (gguf_arch/prune.py): the checkpoint's expert count, and for every
# MoE layer in layer order the original ids of its expert_count kept experts (one flat array).
PRUNED_EXPERT_COUNT = f"{ARCH}.pruned.original_expert_count"
PRUNED_KEPT_EXPERTS = f"{ARCH}.pruned.kept_experts"

# llama-imatrix's GGUF output (gguf_arch/imatrix.py).
GENERAL_TYPE = Keys.General.TYPE
IMATRIX_TYPE = "imatrix"
IMATRIX_DATASETS = Keys.IMatrix.DATASETS
IMATRIX_CHUNK_COUNT = Keys.IMatrix.CHUNK_COUNT
IMATRIX_CHUNK_SIZE = Keys.IMatrix.CHUNK_SIZE


@dataclass(frozen=True)
class Key:
    name: str  # without the "kimi-k3." prefix for arch keys
    vtype: T
    value: Callable[[K3Config], Any]
    sub_type: T | None = None  # arrays only

    @property
    def full_name(self) -> str:
        return self.name if self.name.startswith("general.") else f"{ARCH}.{self.name}"


def _head_count_kv(c: K3Config) -> list[int]:
    # llama.cpp reads 0 as "recurrent (KDA) layer" and 1 as "MLA over one latent KV head".
    return [0 if c.is_kda(l) else 1 for l in range(c.num_layers)]


ARCH_KEYS: tuple[Key, ...] = (
    Key("block_count", T.UINT32, lambda c: c.num_layers),
    Key("context_length", T.UINT32, lambda c: c.context_length),
    Key("embedding_length", T.UINT32, lambda c: c.hidden_size),
    Key("feed_forward_length", T.UINT32, lambda c: c.intermediate_size),
    Key("attention.head_count", T.UINT32, lambda c: c.num_heads),
    Key("attention.head_count_kv", T.ARRAY, _head_count_kv, T.UINT32),
    Key("attention.layer_norm_rms_epsilon", T.FLOAT32, lambda c: c.rms_norm_eps),
    Key("expert_count", T.UINT32, lambda c: c.num_experts),
    Key("expert_used_count", T.UINT32, lambda c: c.num_experts_used),
    Key("expert_group_used_count", T.UINT32, lambda c: c.topk_group),
    Key("expert_gating_func", T.UINT32, lambda c: 2),  # sigmoid (the config reader enforces it)
    Key("vocab_size", T.UINT32, lambda c: c.vocab_size),
    Key("ssm.conv_kernel", T.UINT32, lambda c: c.kda.conv_kernel),
    Key("kda.head_dim", T.UINT32, lambda c: c.kda.head_dim),
    Key("kda.gate_lower_bound", T.FLOAT32, lambda c: c.kda.gate_lower_bound),
    Key("attention.q_lora_rank", T.UINT32, lambda c: c.q_lora_rank),
    Key("attention.kv_lora_rank", T.UINT32, lambda c: c.kv_lora_rank),
    Key("rope.dimension_count", T.UINT32, lambda c: c.qk_rope_head_dim),
    Key("attention.key_length", T.UINT32, lambda c: c.kv_lora_rank + c.qk_rope_head_dim),
    Key("attention.value_length", T.UINT32, lambda c: c.kv_lora_rank),
    Key("attention.key_length_mla", T.UINT32, lambda c: c.qk_head_dim),
    Key("attention.value_length_mla", T.UINT32, lambda c: c.v_head_dim),
    Key("expert_feed_forward_length", T.UINT32, lambda c: c.moe_intermediate_size),
    Key("expert_shared_count", T.UINT32, lambda c: c.num_shared_experts),
    Key("leading_dense_block_count", T.UINT32, lambda c: c.first_k_dense_replace),
    Key("expert_weights_scale", T.FLOAT32, lambda c: c.routed_scaling_factor),
    Key("expert_weights_norm", T.BOOL, lambda c: c.moe_renormalize),
    Key("expert_latent_length", T.UINT32, lambda c: c.latent_size),
    Key("activation.situ_beta", T.FLOAT32, lambda c: c.situ_beta),
    Key("activation.situ_linear_beta", T.FLOAT32, lambda c: c.situ_linear_beta),
    Key("attn_res.block_size", T.UINT32, lambda c: c.attn_res_block_size),
)

DSA_KEYS: tuple[Key, ...] = (
    Key("attention.indexer.head_count", T.UINT32, lambda c: c.indexer.n_heads),
    Key("attention.indexer.key_length", T.UINT32, lambda c: c.indexer.head_dim),
    Key("attention.indexer.top_k", T.UINT32, lambda c: c.indexer.top_k),
    Key("attention.indexer.layers", T.ARRAY, lambda c: list(c.indexer.layers), T.UINT32),
)


def model_keys(cfg: K3Config) -> list[tuple[str, Any, T, T | None]]:
    """(full key, value, type, array element type) for every architecture key of this config."""
    keys = ARCH_KEYS + (DSA_KEYS if cfg.indexer is not None else ())
    return [(k.full_name, k.value(cfg), k.vtype, k.sub_type) for k in keys]
