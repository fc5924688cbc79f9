"""GGUF metadata of the `kimi-k3` architecture and the K3.1-Pro indexer keys (docs/reference/gguf.md,
Keys and Indexer keys), as one table that drives the writer and the reader.

Each row names a key and its GGUF type, and either the K3Config field it holds (written from that
field, read back into it) or the value it derives from other fields (written, and on reading
only compared). `model_keys(cfg)` is the writer's side; `config_from_metadata(meta)` the reader's:
it rebuilds the K3Config from the rows that hold fields, then checks every row against the file
and every value against the config reader's ranges (`config.range_problems`), so no key is spelled
twice and no field has a second inverse.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import numpy as np
from gguf import GGUFValueType as T
from gguf import Keys

from ..errors import GGUFError
from ..io.gguf_values import problem as value_problem
from .config import IndexerConfig, K3Config, KDAConfig, range_problems
from .mxfp4 import BLOCK

ARCH = "kimi-k3"
FILE_TYPE_MXFP4_MOE = 38  # llama.cpp's LLAMA_FTYPE_MOSTLY_MXFP4_MOE
QUANTIZATION_VERSION = 2

# How a key's value gives its fields back: (value, the fields read so far) -> {field: value}.
Read = Callable[[Any, Mapping[str, Any]], Mapping[str, Any]]


@dataclass(frozen=True)
class Key:
    name: str  # without the "kimi-k3." prefix for arch keys
    vtype: T
    field: str | None = None  # the K3Config field it holds ("kda.head_dim": a field of cfg.kda)
    derive: Callable[[K3Config], Any] | None = None  # a value computed from the fields instead
    sub_type: T | None = None  # arrays only
    read: Read | None = None  # a key whose value is not one field: how to get its fields back
    holds: tuple[str, ...] = ()  # the fields `read` returns

    @property
    def fields_held(self) -> tuple[str, ...]:
        return self.holds if self.read is not None else (self.field,) if self.field else ()

    @property
    def full_name(self) -> str:
        return self.name if self.name.startswith("general.") else f"{ARCH}.{self.name}"

    def value(self, cfg: K3Config) -> Any:
        if self.derive is not None:
            return self.derive(cfg)
        return _get(cfg, self.field)

    def fields_from(self, value: Any, so_far: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.read is not None:
            return self.read(value, so_far)
        return {} if self.field is None else {self.field: value}


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return list(cfg) if isinstance(cfg, tuple) else cfg


def _head_count_kv(c: K3Config) -> list[int]:
    # llama.cpp reads 0 as "recurrent (KDA) layer" and 1 as "MLA over one latent KV head".
    return [0 if c.is_kda(l) else 1 for l in range(c.num_layers)]


def _layer_kinds(kv_heads: Any, so_far: Mapping[str, Any]) -> Mapping[str, Any]:
    n_layers = so_far["num_layers"]
    if (not isinstance(kv_heads, list) or len(kv_heads) != n_layers
            or not all(_is_type(T.UINT32, h) and h in (0, 1) for h in kv_heads)):
        raise ValueError(f"must be a list of {n_layers} values 0 (KDA) or 1 (MLA), got {kv_heads!r}")
    return {"kda.layers": tuple(l for l, h in enumerate(kv_heads) if h == 0),
            "mla_layers": tuple(l for l, h in enumerate(kv_heads) if h == 1)}


def indexer_types(num_layers: int, dsa_layers: tuple[int, ...]) -> list[bool]:
    """kimi-k3.attention.indexer.types: true exactly on the DSA layers."""
    return [layer in dsa_layers for layer in range(num_layers)]


def _dsa_layers(types: Any, so_far: Mapping[str, Any]) -> Mapping[str, Any]:
    n_layers = so_far["num_layers"]
    if not isinstance(types, list) or len(types) != n_layers or not all(_is_type(T.BOOL, t) for t in types):
        raise ValueError(f"must be an array of {n_layers} bools (one per layer, true on the DSA layers), "
                         f"got {str(types)[:200]}")
    return {"indexer.layers": tuple(l for l, dsa in enumerate(types) if dsa)}


ARCH_KEYS: tuple[Key, ...] = (
    Key("block_count", T.UINT32, "num_layers"),
    Key("context_length", T.UINT32, "context_length"),
    Key("embedding_length", T.UINT32, "hidden_size"),
    Key("feed_forward_length", T.UINT32, "intermediate_size"),
    # llama.cpp sizes the KDA heads from attention.head_count too (docs/reference/findings.md#llamacpp-limits).
    Key("attention.head_count", T.UINT32, "num_heads", read=lambda v, _: {"num_heads": v, "kda.num_heads": v},
        holds=("num_heads", "kda.num_heads")),
    Key("attention.head_count_kv", T.ARRAY, derive=_head_count_kv, sub_type=T.UINT32, read=_layer_kinds,
        holds=("kda.layers", "mla_layers")),
    Key("attention.layer_norm_rms_epsilon", T.FLOAT32, "rms_norm_eps"),
    Key("expert_count", T.UINT32, "num_experts"),
    Key("expert_used_count", T.UINT32, "num_experts_used"),
    Key("expert_group_used_count", T.UINT32, "topk_group"),
    Key("expert_gating_func", T.UINT32, derive=lambda c: 2),  # sigmoid (the config reader enforces it)
    Key("vocab_size", T.UINT32, "vocab_size"),
    Key("ssm.conv_kernel", T.UINT32, "kda.conv_kernel"),
    Key("kda.head_dim", T.UINT32, "kda.head_dim"),
    Key("kda.gate_lower_bound", T.FLOAT32, "kda.gate_lower_bound"),
    Key("attention.q_lora_rank", T.UINT32, "q_lora_rank"),
    Key("attention.kv_lora_rank", T.UINT32, "kv_lora_rank"),
    Key("rope.dimension_count", T.UINT32, "qk_rope_head_dim"),
    Key("attention.key_length", T.UINT32, derive=lambda c: c.kv_lora_rank + c.qk_rope_head_dim),
    Key("attention.value_length", T.UINT32, derive=lambda c: c.kv_lora_rank),
    Key("attention.key_length_mla", T.UINT32, derive=lambda c: c.qk_head_dim,
        read=lambda v, f: {"qk_nope_head_dim": v - f["qk_rope_head_dim"]}, holds=("qk_nope_head_dim",)),
    Key("attention.value_length_mla", T.UINT32, "v_head_dim"),
    Key("expert_feed_forward_length", T.UINT32, "moe_intermediate_size"),
    Key("expert_shared_count", T.UINT32, "num_shared_experts"),
    Key("leading_dense_block_count", T.UINT32, "first_k_dense_replace"),
    Key("expert_weights_scale", T.FLOAT32, "routed_scaling_factor"),
    Key("expert_weights_norm", T.BOOL, "moe_renormalize"),
    Key("expert_latent_length", T.UINT32, "latent_size"),
    Key("activation.situ_beta", T.FLOAT32, "situ_beta"),
    Key("activation.situ_linear_beta", T.FLOAT32, "situ_linear_beta"),
    Key("attn_res.block_size", T.UINT32, "attn_res_block_size"),
)

DSA_KEYS: tuple[Key, ...] = (
    Key("attention.indexer.head_count", T.UINT32, "indexer.n_heads"),
    Key("attention.indexer.key_length", T.UINT32, "indexer.head_dim"),
    Key("attention.indexer.top_k", T.UINT32, "indexer.top_k"),
    # llama.cpp's convention for per-layer indexer presence (its glm-dsa, glm5-next, hy-v4, dots3note
    # loaders read {arch}.attention.indexer.types with get_key_or_arr): a bool per layer. gguf 0.19.0
    # has no add_indexer_types; the writer's generic add_key_value writes it from this row.
    Key("attention.indexer.types", T.ARRAY, derive=lambda c: indexer_types(c.num_layers, c.indexer.layers),
        sub_type=T.BOOL, read=_dsa_layers, holds=("indexer.layers",)),
)
INDEXER_KEYS = tuple(k.full_name for k in DSA_KEYS)
INDEXER_HEAD_COUNT, INDEXER_KEY_LENGTH, INDEXER_TOP_K, INDEXER_TYPES = INDEXER_KEYS
# The first key this project wrote for the DSA layers (0-based ids, arr[u32]); replaced by
# INDEXER_TYPES (docs/reference/gguf.md#indexer-keys, revision 2026-12). Readers still accept a GGUF with only it.
LEGACY_INDEXER_LAYERS = f"{ARCH}.attention.indexer.layers"

# A GGUF made by kimi-k3-prune (arch/pruned.py): the checkpoint's expert count, and for every MoE
# layer in layer order the original ids of its expert_count kept experts (one flat array).
PRUNED_EXPERT_COUNT = f"{ARCH}.pruned.original_expert_count"
PRUNED_KEPT_EXPERTS = f"{ARCH}.pruned.kept_experts"
EXPERT_COUNT = next(k.full_name for k in ARCH_KEYS if k.field == "num_experts")  # what a pruned file holds

# Fields no key stores, because llama.cpp's kimi-k3 graph hard-wires them; the loader's tensor
# check rejects a file whose layout disagrees.
NOT_STORED: dict[str, Any] = {"moe_layer_freq": 1, "latent_moe_use_norm": True, "mxfp4_group_size": BLOCK}
# The tokenizer's ids (written by tokenizer.py under gguf-py's names); they do not shape the
# graph, so a file written without them reads as -1.
TOKEN_ID_KEYS: dict[str, str] = {"bos_token_id": Keys.Tokenizer.BOS_ID, "eos_token_id": Keys.Tokenizer.EOS_ID,
                                 "pad_token_id": Keys.Tokenizer.PAD_ID}


def model_keys(cfg: K3Config) -> list[tuple[str, Any, T, T | None]]:
    """(full key, value, type, array element type) for every architecture key of this config."""
    keys = ARCH_KEYS + (DSA_KEYS if cfg.indexer is not None else ())
    return [(k.full_name, k.value(cfg), k.vtype, k.sub_type) for k in keys]


def dsa_key_lines(cfg: K3Config) -> list[str]:
    """The DSA keys as the dry run and --print-tensor-types show them (the bool array as the layers it
    marks: 93 booleans do not read)."""
    if cfg.indexer is None:
        return [f"no DSA keys ({ARCH}.attention.indexer.*): a plain {ARCH} GGUF"]
    lines = [f"{k.full_name} = {k.value(cfg)}" for k in DSA_KEYS if k.vtype != T.ARRAY]
    return lines + [f"{INDEXER_TYPES} = arr[bool, {cfg.num_layers}], true on layers {list(cfg.indexer.layers)}"]


# The dry run's first line (convert/listing.py): kimi-k3-doctor recognises a saved listing by it.
DRY_RUN_HEADER = "dry run: nothing written"
# The MoE keys the dry run shows too: with the tensors' bytes, all kimi-k3-doctor needs to plan a
# --mem-budget for a model not converted yet.
MOE_LISTED = ("expert_count", "expert_used_count")


def moe_key_lines(cfg: K3Config) -> list[str]:
    """`kimi-k3.expert_count = N` and `kimi-k3.expert_used_count = K`, as the dry run shows them."""
    return [f"{k.full_name} = {k.value(cfg)}" for k in ARCH_KEYS if k.name in MOE_LISTED]


# ---- the reader's side -----------------------------------------------------------------------

def _need(meta: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in meta:
        raise GGUFError(f"{where}: missing metadata key {key!r}")
    return meta[key]


def _dsa_present(meta: Mapping[str, Any], where: str) -> bool:
    present = [k for k in INDEXER_KEYS if k in meta]
    if present and len(present) != len(INDEXER_KEYS):
        absent = [k for k in INDEXER_KEYS if k not in meta]
        raise GGUFError(f"{where}: has {', '.join(present)} but not {', '.join(absent)} "
                        "(the indexer keys come together or not at all)")
    return bool(present)


def _is_type(vtype: T, value: Any) -> bool:
    """Whether gguf-py's decoded `value` is of the table's GGUF type (bool is no integer here)."""
    if vtype == T.FLOAT32:
        return isinstance(value, float)
    if vtype == T.BOOL:
        return isinstance(value, bool)
    if vtype == T.ARRAY:
        return isinstance(value, list)
    return isinstance(value, int) and not isinstance(value, bool)


def _read_fields(meta: Mapping[str, Any], keys: tuple[Key, ...], where: str) -> dict[str, Any]:
    got: dict[str, Any] = dict(NOT_STORED)
    for k in keys:
        if not k.fields_held:
            continue  # derived only: compared once the config stands
        value = _need(meta, k.full_name, where)
        if not _is_type(k.vtype, value):
            raise GGUFError(f"{where}: metadata {k.full_name} is {value!r}, expected a {k.vtype.name} value")
        try:
            got.update(k.fields_from(value, got))
        except ValueError as exc:
            raise GGUFError(f"{where}: {k.full_name} {exc}") from None
    for field, key in TOKEN_ID_KEYS.items():
        value = meta.get(key, -1)
        if not _is_type(T.UINT32, value):
            raise GGUFError(f"{where}: metadata {key} is {value!r}, expected a token id")
        vocab = got.get("vocab_size")
        # A vocabulary of no tokens is the vocab_size key's own error (its range, checked next).
        if value != -1 and isinstance(vocab, int) and vocab > 0 and value >= vocab:
            raise GGUFError(f"{where}: metadata {key} is {value}, outside the vocabulary (ids 0..{vocab - 1})")
        got[field] = value
    return got


def _build(got: Mapping[str, Any]) -> K3Config:
    """K3Config from dotted field names ("kda.head_dim" goes to cfg.kda)."""
    def part(cls, prefix: str):
        return cls(**{f.name: got[prefix + f.name] for f in fields(cls)})
    top = {f.name: got[f.name] for f in fields(K3Config) if f.name not in ("kda", "indexer")}
    indexer = part(IndexerConfig, "indexer.") if "indexer.n_heads" in got else None
    return K3Config(**top, kda=part(KDAConfig, "kda."), indexer=indexer)


def _same(want: Any, got: Any, vtype: T) -> bool:
    if vtype == T.FLOAT32:
        return isinstance(got, float) and np.float32(want) == np.float32(got)
    if vtype == T.BOOL:
        return isinstance(got, bool) and got == want
    return type(got) is type(want) and got == want


def _check(cfg: K3Config, meta: Mapping[str, Any], where: str) -> None:
    """Every key of the table against the file, then the values against the config's ranges."""
    for key, want, vtype, sub in model_keys(cfg):
        got = _need(meta, key, where)
        why = value_problem(vtype, got, sub)  # a NaN, or a value outside what the type holds
        if why is not None:
            raise GGUFError(f"{where}: metadata {key} {why}")
        if not _same(want, got, vtype):
            raise GGUFError(f"{where}: metadata {key} is {got!r}, expected {want!r} "
                            "(inconsistent with the other kimi-k3 keys)")
    if cfg.indexer is not None and set(cfg.indexer.layers) != set(cfg.mla_layers):
        raise GGUFError(f"{where}: {INDEXER_TYPES} marks layers {list(cfg.indexer.layers)}; they must be the MLA "
                        f"layers {list(cfg.mla_layers)} (head_count_kv == 1)")
    key_of = {field: k.full_name for k in ARCH_KEYS + DSA_KEYS for field in k.fields_held}
    for field, problem in range_problems(cfg):
        if field != "num_experts_used":  # its range is 1..expert_count, below
            raise GGUFError(f"{where}: {key_of.get(field, field)} {problem}")
    if not 1 <= cfg.num_experts_used <= cfg.num_experts:
        raise GGUFError(f"{where}: {key_of['num_experts_used']} {cfg.num_experts_used} must be in "
                        f"1..{key_of['num_experts'].removeprefix(ARCH + '.')} ({cfg.num_experts})")


def config_from_metadata(meta: Mapping[str, Any], where: str) -> K3Config:
    """Rebuild the architecture from the kimi-k3 keys, then check the file against the key table.

    Each K3Config field is read from the one key the table writes it to; the round trip through
    `model_keys(cfg)` then compares every key of the table with the file, so a wrong value, a
    wrong type or a missing key is reported against the table, not against a copy of it.
    """
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{where}: general.architecture is {arch!r}, expected {ARCH!r}")
    meta, _notes = upgrade_legacy_keys(meta, where)
    keys = ARCH_KEYS + (DSA_KEYS if _dsa_present(meta, where) else ())
    cfg = _build(_read_fields(meta, keys, where))
    _check(cfg, meta, where)
    return cfg


def upgrade_legacy_keys(meta: Mapping[str, Any], where: str) -> tuple[Mapping[str, Any], tuple[str, ...]]:
    """A GGUF converted before kimi-k3.attention.indexer.types records its DSA layers as ids in
    kimi-k3.attention.indexer.layers: the metadata with that read as the bool array, and a note
    saying so (none for a current file)."""
    if LEGACY_INDEXER_LAYERS not in meta or INDEXER_TYPES in meta:
        return meta, ()
    layers, n = meta[LEGACY_INDEXER_LAYERS], meta.get(next(k.full_name for k in ARCH_KEYS if k.field == "num_layers"))
    if not (_is_type(T.UINT32, n) and isinstance(layers, list)
            and all(_is_type(T.UINT32, l) and 0 <= l < n for l in layers)):
        raise GGUFError(f"{where}: {LEGACY_INDEXER_LAYERS} must be 0-based layer ids below "
                        f"{ARCH}.block_count ({n!r}), got {str(layers)[:200]}")
    upgraded = {k: v for k, v in meta.items() if k != LEGACY_INDEXER_LAYERS}
    upgraded[INDEXER_TYPES] = indexer_types(n, tuple(layers))
    return upgraded, (f"DSA layers read from {LEGACY_INDEXER_LAYERS}, the key of GGUFs converted before "
                      f"{INDEXER_TYPES} (llama.cpp's); reconvert to write it",)
