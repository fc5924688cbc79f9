"""The architecture fields of Kimi K3 / K3.1-Pro's `config.json` as one table, with their rules.

Each row names one HF field once: where it sits, its type, the K3Config field it fills, its range
and, where Kimi K3 allows one value only, that value (config.py reads the file with it; the GGUF
key of each field is in keys.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType as T

from ..io.gguf_values import describe
from ..io.gguf_values import problem as value_problem
from .mxfp4 import BLOCK

TOP_LEVEL_ARCH = "KimiK3ForConditionalGeneration"
MXFP4_FORMAT = "mxfp4-pack-quantized"

INT, FLOAT, BOOL, STR, LIST = "int", "float", "bool", "str", "list"
TEXT = "text_config."
KDA = "text_config.linear_attn_config."
POSITIVE = "positive"  # ints >= 1, floats > 0 (SiTU divides by its betas)
BLOCKS = "blocks"  # a positive multiple of the MXFP4 block
ANY = object()  # no fixed value


@dataclass(frozen=True)
class Field:
    """One architecture field of config.json. Every one is required; all missing ones are
    reported together."""

    hf: str  # its name in its section
    kind: str
    attr: str | None = None  # the K3Config field it fills ("kda.head_dim"); None: only checked
    rule: str | None = None  # POSITIVE or BLOCKS
    fixed: Any = ANY  # the one value the K3 graph hard-wires; another describes another model
    section: str = TEXT

    @property
    def where(self) -> str:
        return self.section + self.hf


def _kda(hf: str, kind: str, attr: str | None = None, rule: str | None = None) -> Field:
    return Field(hf, kind, attr, rule, section=KDA)


FIELDS: tuple[Field, ...] = (
    Field("vocab_size", INT, "vocab_size", POSITIVE),
    Field("hidden_size", INT, "hidden_size", POSITIVE),
    Field("num_hidden_layers", INT, "num_layers", POSITIVE),
    Field("num_attention_heads", INT, "num_heads", POSITIVE),
    Field("num_key_value_heads", INT),
    Field("intermediate_size", INT, "intermediate_size", POSITIVE),
    Field("moe_intermediate_size", INT, "moe_intermediate_size", BLOCKS),
    Field("num_experts", INT, "num_experts", POSITIVE),
    Field("num_experts_per_token", INT, "num_experts_used", POSITIVE),
    Field("num_shared_experts", INT, "num_shared_experts"),
    Field("first_k_dense_replace", INT, "first_k_dense_replace"),
    Field("moe_layer_freq", INT, "moe_layer_freq", POSITIVE),
    Field("routed_expert_hidden_size", INT, "latent_size", BLOCKS),
    Field("latent_moe_use_norm", BOOL, "latent_moe_use_norm"),
    Field("moe_router_activation_func", STR, fixed="sigmoid"),
    Field("moe_renormalize", BOOL, "moe_renormalize"),
    Field("routed_scaling_factor", FLOAT, "routed_scaling_factor"),
    Field("topk_method", STR),
    Field("num_expert_group", INT, fixed=1),
    Field("topk_group", INT, "topk_group"),
    Field("q_lora_rank", INT, "q_lora_rank", POSITIVE),
    Field("kv_lora_rank", INT, "kv_lora_rank", POSITIVE),
    Field("qk_nope_head_dim", INT, "qk_nope_head_dim", POSITIVE),
    Field("qk_rope_head_dim", INT, "qk_rope_head_dim"),
    Field("v_head_dim", INT, "v_head_dim", POSITIVE),
    Field("mla_use_nope", BOOL, fixed=True),
    Field("mla_use_output_gate", BOOL, fixed=True),
    Field("hidden_act", STR, fixed="situ"),
    Field("activation_situ_beta", FLOAT, "situ_beta", POSITIVE),
    Field("activation_situ_linear_beta", FLOAT, "situ_linear_beta", POSITIVE),
    Field("attn_res_block_size", INT, "attn_res_block_size", POSITIVE),
    Field("rms_norm_eps", FLOAT, "rms_norm_eps", POSITIVE),
    Field("max_position_embeddings", INT, "context_length", POSITIVE),
    Field("num_nextn_predict_layers", INT, fixed=0),
    Field("tie_word_embeddings", BOOL, fixed=False),
    Field("bos_token_id", INT, "bos_token_id"),
    Field("eos_token_id", INT, "eos_token_id"),
    Field("pad_token_id", INT, "pad_token_id"),
    _kda("num_heads", INT, "kda.num_heads", POSITIVE),
    _kda("head_dim", INT, "kda.head_dim", POSITIVE),
    _kda("short_conv_kernel_size", INT, "kda.conv_kernel", POSITIVE),
    Field("use_full_rank_gate", BOOL, fixed=True, section=KDA),  # one g_proj
    _kda("gate_lower_bound", FLOAT, "kda.gate_lower_bound"),
    _kda("kda_layers", LIST, "kda.layers"),  # 1-based lists, read by _layer_kinds
    _kda("full_attn_layers", LIST, "mla_layers"),
)
ROW = {f.attr: f for f in FIELDS if f.attr is not None}

# K3.1-Pro's lightning indexer: the four come together or not at all.
INDEX_FIELDS: tuple[Field, ...] = (
    Field("index_n_heads", INT, "indexer.n_heads", POSITIVE),
    Field("index_head_dim", INT, "indexer.head_dim", POSITIVE),
    Field("index_topk", INT, "indexer.top_k", POSITIVE),
    Field("index_layers", LIST, "indexer.layers"),
)


# What each kind becomes in the GGUF: every integer field of K3 is written as (or checked against)
# a uint32 key, every float as a float32 one; a value that type cannot hold is refused here, with
# the field's name, not as a struct.error while the header is packed.
GGUF_TYPE = {INT: T.UINT32, FLOAT: T.FLOAT32}


def kind_text(kind: str) -> str:
    return describe(GGUF_TYPE[kind]) if kind in GGUF_TYPE else kind


def type_ok(kind: str, value: Any) -> bool:
    if kind in GGUF_TYPE:
        return value_problem(GGUF_TYPE[kind], value) is None
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == STR:
        return isinstance(value, str)
    return isinstance(value, list)


def rule_problems(f: Field, value: Any) -> list[str]:
    """What is wrong with `value` under the field's rule (nothing: an empty list)."""
    if f.rule is None:
        return []
    if f.kind == FLOAT:
        if not math.isfinite(value):
            return [f"must be finite and > 0, got {value}"]
        return [] if value > 0 else [f"must be > 0, got {value}"]
    problems = [] if value >= 1 else [f"must be >= 1, got {value}"]
    if f.rule == BLOCKS and value % BLOCK:
        problems.append(f"must be a multiple of {BLOCK} (MXFP4 blocks), got {value}")
    return problems
