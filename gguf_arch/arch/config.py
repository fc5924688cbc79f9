"""Strict reader for the Kimi K3 / K3.1-Pro `config.json`, by the field table of config_fields.py.

The released file is a multimodal wrapper: the text model's fields live in `text_config`, and
`quantization_config` lives only inside `text_config`. Generation boilerplate that sits beside the
architecture fields (`top_k: 50`, `max_length: 20`, the derived `head_dim`) is never read: only
the rows of `FIELDS` are architecture. The GGUF reader checks the same ranges on a K3Config read
back from a file (`range_problems`; the GGUF key of each field is in `keys.py`).

Layer lists in the file are 1-based; everything this module returns is 0-based.
"""
from __future__ import annotations

from itertools import islice
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..io.jsonfile import read_json
from .mxfp4 import BLOCK
from .config_fields import (ANY, FIELDS, FLOAT, INDEX_FIELDS, INT, KDA, LIST, MXFP4_FORMAT, ROW, TEXT, Field,
                            TOP_LEVEL_ARCH, kind_text, rule_problems, type_ok)


@dataclass(frozen=True)
class IndexerConfig:
    """K3.1-Pro lightning indexer (docs/reference/config.md#k31-pro-indexer-fields)."""

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
        return replace(self, indexer=None)


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def range_problems(cfg: K3Config) -> list[tuple[str, str]]:
    """(K3Config field, problem) for every field outside its row's range, in table order."""
    found = []
    for f in FIELDS + (INDEX_FIELDS if cfg.indexer is not None else ()):  # top_k 0 divides by zero
        if f.rule is not None:
            found.extend((f.attr, p) for p in rule_problems(f, _get(cfg, f.attr)))
    return found


def _one_based_layers(name: str, value: Any, n_layers: int, errors: list[str]) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type_ok(INT, v) for v in value):
        errors.append(f"{name} must be a list of integers (1-based layer numbers), got {value!r}")
        return ()
    bad = [v for v in value if not 1 <= v <= n_layers]
    if bad:
        errors.append(f"{name} has layer numbers outside 1..{n_layers} (the list is 1-based): {bad}")
    if value != sorted(set(value)):
        errors.append(f"{name} must be sorted and without duplicates, got {value}")
    return tuple(v - 1 for v in value if 1 <= v <= n_layers)


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
    if sizes != {BLOCK}:
        errors.append(f"text_config.quantization_config weights.group_size must be {BLOCK} (MXFP4), "
                      f"got {sorted(map(str, sizes))}")
        return 0
    return BLOCK


def _indexer(text: dict, n_layers: int, mla_layers: tuple[int, ...], errors: list[str]) -> IndexerConfig | None:
    present = [f.hf for f in INDEX_FIELDS if f.hf in text]
    if not present:
        return None
    absent = [f.hf for f in INDEX_FIELDS if f.hf not in text]
    if absent:
        errors.append(f"text_config has {', '.join(present)} but not {', '.join(absent)}: "
                      "the four index_* fields come together or not at all")
        return None
    *counts, layers_row = INDEX_FIELDS
    for f in counts:
        v = text[f.hf]
        if not type_ok(f.kind, v) or v < 1:
            errors.append(f"{f.where} must be an integer >= 1, got {v!r}")
    layers = _one_based_layers(layers_row.where, text[layers_row.hf], n_layers, errors)
    if set(layers) != set(mla_layers):  # a duplicate is reported by _one_based_layers, as such
        full = ROW["mla_layers"]
        errors.append(
            f"{layers_row.where} must equal {full.where.removeprefix(TEXT)} exactly; "
            f"only in {layers_row.hf}: {[l + 1 for l in sorted(set(layers) - set(mla_layers))]}, "
            f"only in {full.hf}: {[l + 1 for l in sorted(set(mla_layers) - set(layers))]} (1-based)"
        )
    return IndexerConfig(*(text[f.hf] for f in counts), layers)


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


def _collect(t: dict, source: str) -> dict[Field, Any]:
    """Every field's value, type-checked; ConfigError lists every missing or mistyped one."""
    missing: list[str] = []
    wrong: list[str] = []
    got: dict[Field, Any] = {}
    kda = t.get("linear_attn_config")
    for f in FIELDS:
        if f.section == KDA and not isinstance(kda, dict):
            missing.append(KDA.rstrip("."))
            kda = {}
        section = t if f.section == TEXT else kda
        if f.hf not in section:
            missing.append(f.where)
        elif not type_ok(f.kind, section[f.hf]):
            wrong.append(f"{f.where} must be {kind_text(f.kind)}, got {section[f.hf]!r}")
        else:
            got[f] = section[f.hf]
    if missing:
        raise ConfigError(f"{source}: missing required field(s): {', '.join(missing)}")
    if wrong:
        raise ConfigError(f"{source}: {'; '.join(wrong)}")
    return got


def _value_problems(got: dict[Field, Any]) -> list[str]:
    """Fixed values, ranges, and the checks that read two fields."""
    errors = [f"{f.where} must be {f.fixed!r} for Kimi K3, got {v!r}"
              for f, v in got.items() if f.fixed is not ANY and v != f.fixed]
    errors += [f"{f.where} {p}" for f, v in got.items() for p in rule_problems(f, v)]
    used, experts = got[ROW["num_experts_used"]], got[ROW["num_experts"]]
    if used > experts:
        errors.append(f"{ROW['num_experts_used'].where} ({used}) exceeds {ROW['num_experts'].hf} ({experts})")
    if got[ROW["kda.num_heads"]] > got[ROW["kda.head_dim"]]:
        errors.append(f"{ROW['kda.num_heads'].where} must not exceed {ROW['kda.head_dim'].hf} "
                      "(A_log is stored as [head_dim] with the per-head values first)")
    return errors


_LISTED_LAYERS = 16  # uncovered layers named in the error; the rest counted


def _layer_kinds(got: dict[Field, Any], errors: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(KDA layers, MLA layers), 0-based; every layer exactly one of the two."""
    n = got[ROW["num_layers"]]
    kda_row, mla_row = ROW["kda.layers"], ROW["mla_layers"]
    kda_layers = _one_based_layers(kda_row.where, got[kda_row], n, errors)
    mla_layers = _one_based_layers(mla_row.where, got[mla_row], n, errors)
    both = sorted(set(kda_layers) & set(mla_layers))
    covered = set(kda_layers) | set(mla_layers)
    if both:
        errors.append(f"layers {[l + 1 for l in both]} are in both {kda_row.hf} and {mla_row.hf} (1-based)")
    if len(covered) < n:  # n may be 2^32 - 1: name the first few uncovered layers, never build range(n)
        neither = list(islice((l for l in range(n) if l not in covered), _LISTED_LAYERS))
        more = f" and {n - len(covered) - len(neither)} more" if n - len(covered) > len(neither) else ""
        errors.append(f"layers {[l + 1 for l in neither]}{more} are in neither {kda_row.hf} nor {mla_row.hf} "
                      "(1-based)")
    return kda_layers, mla_layers


def _build(got: dict[Field, Any], kda_layers: tuple[int, ...], mla_layers: tuple[int, ...], group: int,
           indexer: IndexerConfig | None) -> K3Config:
    values = {f.attr: float(v) if f.kind == FLOAT else v for f, v in got.items()
              if f.attr is not None and f.kind != LIST}
    kda = KDAConfig(**{k.name: values["kda." + k.name] for k in fields(KDAConfig) if k.name != "layers"},
                    layers=kda_layers)
    top = {k: v for k, v in values.items() if not k.startswith("kda.")}
    return K3Config(**top, kda=kda, mla_layers=mla_layers, mxfp4_group_size=group, indexer=indexer)


def parse_config(raw: dict, source: str = "config.json") -> K3Config:
    """Validate a parsed config.json and return the architecture; ConfigError lists every problem."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    t = text_section(raw)
    got = _collect(t, source)
    errors = _value_problems(got)
    kda_layers, mla_layers = _layer_kinds(got, errors)
    group = _mxfp4_group_size(t, errors)
    indexer = _indexer(t, got[ROW["num_layers"]], mla_layers, errors)
    if errors:
        raise ConfigError(f"{source}: {'; '.join(errors)}")
    return _build(got, kda_layers, mla_layers, group, indexer)


def read_config_json(model_dir: Path | str) -> tuple[Path, Any]:
    """`model_dir/config.json` and its parsed JSON, not yet validated."""
    path = Path(model_dir) / "config.json"
    return path, read_json(path, ConfigError, "not found (expected a Kimi K3 checkpoint directory)")


def load_config(model_dir: Path | str) -> K3Config:
    """Read and validate `model_dir/config.json`."""
    path, raw = read_config_json(model_dir)
    return parse_config(raw, str(path))
