"""Strict reader for the Kimi K3 / K3.1-Pro `config.json`.

The released file is a multimodal wrapper: the text model's fields live in `text_config`, and
`quantization_config` lives only inside `text_config`. Generation boilerplate that sits beside the
architecture fields (`top_k: 50`, `max_length: 20`, the derived `head_dim`) is never read: only
the names in `_TEXT_FIELDS` and `_KDA_FIELDS` are architecture.

Layer lists in the file are 1-based; everything this module returns is 0-based.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as T

from ..errors import ConfigError
from ..io.gguf_values import describe
from ..io.gguf_values import problem as value_problem
from ..io.jsonfile import read_json

TOP_LEVEL_ARCH = "KimiK3ForConditionalGeneration"

# Field name -> value checker. Every one is required; all missing ones are reported together.
_Int = "int"
_Float = "float"
_Bool = "bool"
_Str = "str"
_List = "list"

_TEXT_FIELDS: dict[str, str] = {
    "vocab_size": _Int,
    "hidden_size": _Int,
    "num_hidden_layers": _Int,
    "num_attention_heads": _Int,
    "num_key_value_heads": _Int,
    "intermediate_size": _Int,
    "moe_intermediate_size": _Int,
    "num_experts": _Int,
    "num_experts_per_token": _Int,
    "num_shared_experts": _Int,
    "first_k_dense_replace": _Int,
    "moe_layer_freq": _Int,
    "routed_expert_hidden_size": _Int,
    "latent_moe_use_norm": _Bool,
    "moe_router_activation_func": _Str,
    "moe_renormalize": _Bool,
    "routed_scaling_factor": _Float,
    "topk_method": _Str,
    "num_expert_group": _Int,
    "topk_group": _Int,
    "q_lora_rank": _Int,
    "kv_lora_rank": _Int,
    "qk_nope_head_dim": _Int,
    "qk_rope_head_dim": _Int,
    "v_head_dim": _Int,
    "mla_use_nope": _Bool,
    "mla_use_output_gate": _Bool,
    "hidden_act": _Str,
    "activation_situ_beta": _Float,
    "activation_situ_linear_beta": _Float,
    "attn_res_block_size": _Int,
    "rms_norm_eps": _Float,
    "max_position_embeddings": _Int,
    "num_nextn_predict_layers": _Int,
    "tie_word_embeddings": _Bool,
    "bos_token_id": _Int,
    "eos_token_id": _Int,
    "pad_token_id": _Int,
}

_KDA_FIELDS: dict[str, str] = {
    "num_heads": _Int,
    "head_dim": _Int,
    "short_conv_kernel_size": _Int,
    "use_full_rank_gate": _Bool,
    "gate_lower_bound": _Float,
    "kda_layers": _List,
    "full_attn_layers": _List,
}

INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk", "index_layers")

MXFP4_FORMAT = "mxfp4-pack-quantized"

# Values the K3 graph hard-wires; a config that says otherwise describes another model.
_FIXED_VALUES: dict[str, Any] = {
    "hidden_act": "situ",
    "moe_router_activation_func": "sigmoid",
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "num_expert_group": 1,
}


# What each kind becomes in the GGUF: every integer field of K3 is written as (or checked against)
# a uint32 key, every float as a float32 one; a value that type cannot hold is refused here, with
# the field's name, not as a struct.error while the header is packed.
_GGUF_TYPE = {_Int: T.UINT32, _Float: T.FLOAT32}


def _kind_text(kind: str) -> str:
    return describe(_GGUF_TYPE[kind]) if kind in _GGUF_TYPE else kind


def _type_ok(kind: str, value: Any) -> bool:
    if kind in _GGUF_TYPE:
        return value_problem(_GGUF_TYPE[kind], value) is None
    if kind == _Bool:
        return isinstance(value, bool)
    if kind == _Str:
        return isinstance(value, str)
    return isinstance(value, list)


@dataclass(frozen=True)
class IndexerConfig:
    """K3.1-Pro lightning indexer (contract section 1)."""

    n_heads: int
    head_dim: int
    top_k: int
    layers: tuple[int, ...]  # 0-based


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_kernel: int
    gate_lower_bound: float
    layers: tuple[int, ...]  # 0-based

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class K3Config:
    """The text model's architecture, 0-based layer ids throughout."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # MLA heads
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_used: int
    num_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    latent_size: int  # routed_expert_hidden_size
    latent_moe_use_norm: bool
    moe_renormalize: bool
    routed_scaling_factor: float
    topk_group: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int
    rms_norm_eps: float
    context_length: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    kda: KDAConfig
    mla_layers: tuple[int, ...]  # 0-based full-attention layers
    mxfp4_group_size: int
    indexer: IndexerConfig | None

    # --- layer kinds: the single place that decides what each layer is -------------------
    def is_kda(self, layer: int) -> bool:
        return layer in self.kda.layers

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layers

    def is_dsa(self, layer: int) -> bool:
        return self.indexer is not None and layer in self.indexer.layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def attn_kind(self, layer: int) -> str:
        return "kda" if self.is_kda(layer) else "mla"

    def ffn_kind(self, layer: int) -> str:
        return "moe" if self.is_moe(layer) else "dense"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_layers) if self.is_moe(l))

    @property
    def shared_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def without_indexer(self) -> "K3Config":
        """The same model read as plain K3 (the DSA-off conversion)."""
        from dataclasses import replace

        return replace(self, indexer=None)


def _one_based_layers(name: str, value: Any, n_layers: int, errors: list[str]) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_type_ok(_Int, v) for v in value):
        errors.append(f"{name} must be a list of integers (1-based layer numbers), got {value!r}")
        return ()
    bad = [v for v in value if not 1 <= v <= n_layers]
    if bad:
        errors.append(f"{name} has layer numbers outside 1..{n_layers} (the list is 1-based): {bad}")
    if value != sorted(set(value)):
        errors.append(f"{name} must be sorted and without duplicates, got {value}")
    return tuple(v - 1 for v in value if 1 <= v <= n_layers)


def _collect(section: dict, fields: dict[str, str], where: str, missing: list[str], wrong: list[str]) -> dict:
    out = {}
    for name, kind in fields.items():
        if name not in section:
            missing.append(f"{where}{name}")
        elif not _type_ok(kind, section[name]):
            wrong.append(f"{where}{name} must be {_kind_text(kind)}, got {section[name]!r}")
        else:
            out[name] = section[name]
    return out


def _mxfp4_group_size(text: dict, errors: list[str]) -> int:
    q = text.get("quantization_config")
    if not isinstance(q, dict):
        errors.append("text_config.quantization_config is missing (the routed experts must be "
                      f"compressed-tensors {MXFP4_FORMAT})")
        return 0
    groups = q.get("config_groups")
    fmt = q.get("format")
    group_list = list(groups.values()) if isinstance(groups, dict) else []
    formats = {fmt} | {g.get("format") for g in group_list if isinstance(g, dict)}
    formats.discard(None)
    if q.get("quant_method") != "compressed-tensors" or formats != {MXFP4_FORMAT}:
        errors.append("text_config.quantization_config must be quant_method 'compressed-tensors' with "
                      f"format '{MXFP4_FORMAT}', got quant_method={q.get('quant_method')!r} "
                      f"format={sorted(map(str, formats))}")
        return 0
    sizes = {g.get("weights", {}).get("group_size") for g in group_list if isinstance(g, dict)}
    if sizes != {32}:
        errors.append(f"text_config.quantization_config weights.group_size must be 32 (MXFP4), got {sorted(map(str, sizes))}")
        return 0
    return 32


def _indexer(text: dict, n_layers: int, mla_layers: tuple[int, ...], errors: list[str]) -> IndexerConfig | None:
    present = [f for f in INDEX_FIELDS if f in text]
    if not present:
        return None
    absent = [f for f in INDEX_FIELDS if f not in text]
    if absent:
        errors.append(f"text_config has {', '.join(present)} but not {', '.join(absent)}: "
                      "the four index_* fields come together or not at all")
        return None
    vals = {}
    for f in ("index_n_heads", "index_head_dim", "index_topk"):
        v = text[f]
        if not _type_ok(_Int, v) or v < 1:
            errors.append(f"text_config.{f} must be an integer >= 1, got {v!r}")
        vals[f] = v
    layers = _one_based_layers("text_config.index_layers", text["index_layers"], n_layers, errors)
    if set(layers) != set(mla_layers):  # a duplicate is reported by _one_based_layers, as such
        only_index = sorted(set(layers) - set(mla_layers))
        only_full = sorted(set(mla_layers) - set(layers))
        errors.append(
            "text_config.index_layers must equal linear_attn_config.full_attn_layers exactly; "
            f"only in index_layers: {[l + 1 for l in only_index]}, "
            f"only in full_attn_layers: {[l + 1 for l in only_full]} (1-based)"
        )
    return IndexerConfig(vals["index_n_heads"], vals["index_head_dim"], vals["index_topk"], layers)


def _check_fixed_and_sizes(t: dict, kda: dict, errors: list[str]) -> None:
    for name, want in _FIXED_VALUES.items():
        if name in t and t[name] != want:
            errors.append(f"text_config.{name} must be {want!r} for Kimi K3, got {t[name]!r}")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "moe_intermediate_size", "num_experts", "num_experts_per_token", "routed_expert_hidden_size",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "attn_res_block_size",
                 "moe_layer_freq", "max_position_embeddings"):
        if name in t and t[name] < 1:
            errors.append(f"text_config.{name} must be >= 1, got {t[name]}")
    if t.get("num_experts_per_token", 0) > t.get("num_experts", 1 << 62):
        errors.append(f"text_config.num_experts_per_token ({t['num_experts_per_token']}) exceeds num_experts ({t['num_experts']})")
    for name in ("routed_expert_hidden_size", "moe_intermediate_size"):
        if name in t and t[name] % 32:
            errors.append(f"text_config.{name} must be a multiple of 32 (MXFP4 blocks), got {t[name]}")
    for name in ("rms_norm_eps", "activation_situ_beta", "activation_situ_linear_beta"):  # SiTU divides by the betas
        if name in t and not t[name] > 0:
            errors.append(f"text_config.{name} must be > 0, got {t[name]}")
    if kda.get("use_full_rank_gate") is False:
        errors.append("text_config.linear_attn_config.use_full_rank_gate must be true for Kimi K3 (one g_proj)")
    for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
        if name in kda and kda[name] < 1:
            errors.append(f"text_config.linear_attn_config.{name} must be >= 1, got {kda[name]}")
    if kda.get("num_heads", 0) > kda.get("head_dim", 1 << 62):
        errors.append("text_config.linear_attn_config.num_heads must not exceed head_dim "
                      "(A_log is stored as [head_dim] with the per-head values first)")


def text_section(raw: dict) -> dict:
    """The text model's fields: `text_config` of the multimodal wrapper, or the file itself."""
    if "text_config" in raw:
        archs = raw.get("architectures")
        if archs is not None and (not isinstance(archs, list) or TOP_LEVEL_ARCH not in archs):
            raise ConfigError(f"config.json: architectures is {archs}, expected {TOP_LEVEL_ARCH!r}")
        if not isinstance(raw["text_config"], dict):
            raise ConfigError("config.json: text_config must be an object")
        return raw["text_config"]
    return raw


def parse_config(raw: dict, source: str = "config.json") -> K3Config:
    """Validate a parsed config.json and return the architecture; ConfigError lists every problem."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    t = text_section(raw)
    missing: list[str] = []
    errors: list[str] = []
    got = _collect(t, _TEXT_FIELDS, "text_config.", missing, errors)
    lac = t.get("linear_attn_config")
    if not isinstance(lac, dict):
        missing.append("text_config.linear_attn_config")
        lac = {}
    kda = _collect(lac, _KDA_FIELDS, "text_config.linear_attn_config.", missing, errors)
    if missing:
        raise ConfigError(f"{source}: missing required field(s): {', '.join(missing)}")
    if errors:
        raise ConfigError(f"{source}: {'; '.join(errors)}")

    _check_fixed_and_sizes(got, kda, errors)
    n = got["num_hidden_layers"]
    kda_layers = _one_based_layers("text_config.linear_attn_config.kda_layers", kda["kda_layers"], n, errors)
    mla_layers = _one_based_layers("text_config.linear_attn_config.full_attn_layers", kda["full_attn_layers"], n, errors)
    both = sorted(set(kda_layers) & set(mla_layers))
    neither = sorted(set(range(n)) - set(kda_layers) - set(mla_layers))
    if both:
        errors.append(f"layers {[l + 1 for l in both]} are in both kda_layers and full_attn_layers (1-based)")
    if neither:
        errors.append(f"layers {[l + 1 for l in neither]} are in neither kda_layers nor full_attn_layers (1-based)")
    group = _mxfp4_group_size(t, errors)
    indexer = _indexer(t, n, mla_layers, errors)
    if errors:
        raise ConfigError(f"{source}: {'; '.join(errors)}")

    return K3Config(
        vocab_size=got["vocab_size"],
        hidden_size=got["hidden_size"],
        num_layers=n,
        num_heads=got["num_attention_heads"],
        intermediate_size=got["intermediate_size"],
        moe_intermediate_size=got["moe_intermediate_size"],
        num_experts=got["num_experts"],
        num_experts_used=got["num_experts_per_token"],
        num_shared_experts=got["num_shared_experts"],
        first_k_dense_replace=got["first_k_dense_replace"],
        moe_layer_freq=got["moe_layer_freq"],
        latent_size=got["routed_expert_hidden_size"],
        latent_moe_use_norm=got["latent_moe_use_norm"],
        moe_renormalize=got["moe_renormalize"],
        routed_scaling_factor=float(got["routed_scaling_factor"]),
        topk_group=got["topk_group"],
        q_lora_rank=got["q_lora_rank"],
        kv_lora_rank=got["kv_lora_rank"],
        qk_nope_head_dim=got["qk_nope_head_dim"],
        qk_rope_head_dim=got["qk_rope_head_dim"],
        v_head_dim=got["v_head_dim"],
        situ_beta=float(got["activation_situ_beta"]),
        situ_linear_beta=float(got["activation_situ_linear_beta"]),
        attn_res_block_size=got["attn_res_block_size"],
        rms_norm_eps=float(got["rms_norm_eps"]),
        context_length=got["max_position_embeddings"],
        bos_token_id=got["bos_token_id"],
        eos_token_id=got["eos_token_id"],
        pad_token_id=got["pad_token_id"],
        kda=KDAConfig(kda["num_heads"], kda["head_dim"], kda["short_conv_kernel_size"],
                      float(kda["gate_lower_bound"]), kda_layers),
        mla_layers=mla_layers,
        mxfp4_group_size=group,
        indexer=indexer,
    )


def read_config_json(model_dir: Path | str) -> tuple[Path, Any]:
    """`model_dir/config.json` and its parsed JSON, not yet validated."""
    path = Path(model_dir) / "config.json"
    return path, read_json(path, ConfigError, "not found (expected a Kimi K3 checkpoint directory)")


def load_config(model_dir: Path | str) -> K3Config:
    """Read and validate `model_dir/config.json`."""
    path, raw = read_config_json(model_dir)
    return parse_config(raw, str(path))
