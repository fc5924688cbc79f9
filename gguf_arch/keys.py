"""GGUF metadata of the `kimi-k3` architecture (k3-spec E.2) and the K3.1-Pro indexer keys
(contract section 5), as one table that the writer and the graph loader share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gguf import GGUFValueType as T

from .config import K3Config

ARCH = "kimi-k3"
FILE_TYPE_MXFP4_MOE = 38  # llama.cpp's LLAMA_FTYPE_MOSTLY_MXFP4_MOE
QUANTIZATION_VERSION = 2

INDEXER_HEAD_COUNT = f"{ARCH}.attention.indexer.head_count"
INDEXER_KEY_LENGTH = f"{ARCH}.attention.indexer.key_length"
INDEXER_TOP_K = f"{ARCH}.attention.indexer.top_k"
INDEXER_TYPES = f"{ARCH}.attention.indexer.types"
INDEXER_KEYS = (INDEXER_HEAD_COUNT, INDEXER_KEY_LENGTH, INDEXER_TOP_K, INDEXER_TYPES)
# The first key this project wrote for the DSA layers (0-based ids, arr[u32]); replaced by
# INDEXER_TYPES (contract section 5, revision 2026-12). Readers still accept a GGUF that has only it.
LEGACY_INDEXER_LAYERS = f"{ARCH}.attention.indexer.layers"


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
    # llama.cpp's convention for per-layer indexer presence (its glm-dsa, glm5-next, hy-v4, dots3note
    # loaders read {arch}.attention.indexer.types with get_key_or_arr): a bool per layer.
    Key("attention.indexer.types", T.ARRAY, lambda c: indexer_types(c.num_layers, c.indexer.layers), T.BOOL),
)


def indexer_types(num_layers: int, dsa_layers: tuple[int, ...]) -> list[bool]:
    """kimi-k3.attention.indexer.types: true exactly on the DSA layers."""
    return [layer in dsa_layers for layer in range(num_layers)]


def dsa_key_lines(cfg: K3Config) -> list[str]:
    """The DSA keys as the dry run and --print-tensor-types show them (the bool array as the layers it
    marks: 93 booleans do not read)."""
    if cfg.indexer is None:
        return [f"no DSA keys ({ARCH}.attention.indexer.*): a plain {ARCH} GGUF"]
    lines = [f"{ARCH}.{k.name} = {k.value(cfg)}" for k in DSA_KEYS if k.vtype != T.ARRAY]
    return lines + [f"{INDEXER_TYPES} = arr[bool, {cfg.num_layers}], true on layers {list(cfg.indexer.layers)}"]


def model_keys(cfg: K3Config) -> list[tuple[str, Any, T, T | None]]:
    """(full key, value, type, array element type) for every architecture key of this config."""
    keys = ARCH_KEYS + (DSA_KEYS if cfg.indexer is not None else ())
    return [(k.full_name, k.value(cfg), k.vtype, k.sub_type) for k in keys]
