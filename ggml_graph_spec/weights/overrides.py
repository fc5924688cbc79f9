"""--override-kv: GGUF metadata values a run replaces, checked before any ggml object exists.

The key must be one the runtime reads (the key table's, or the tokenizer's ids and add-BOS flag),
the value of the file's type and within what the key's GGUF type holds (a uint32 is never
negative), and the config rebuilt from the overridden keys passes the loader's own checks (ranges
included) and keeps every tensor's shape: a ggml op on a mis-shaped tensor aborts. The loader calls
`apply_overrides` before it maps a byte (`load_gguf(adjust=...)`).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from gguf import GGUFValueType as T
from gguf import Keys

from gguf_arch.arch import keys as K
from gguf_arch.arch.config import K3Config
from gguf_arch.arch.tensors import plan_tensors
from gguf_arch.io.console import UsageError
from gguf_arch.io.gguf_values import problem as value_problem

# The tokenizer keys an override may change, with the tokenizer attribute each sets; gguf-py
# writes the ids as uint32 and the flag as a bool.
TOKENIZER_OVERRIDES = {Keys.Tokenizer.BOS_ID: ("bos_id", T.UINT32), Keys.Tokenizer.EOS_ID: ("eos_id", T.UINT32),
                       Keys.Tokenizer.ADD_BOS: ("add_bos", T.BOOL)}


def _override_type_matches(value: Any, current: Any) -> bool:
    # bool is an int subclass: compare exact types, except that an int may override a float.
    return type(value) is type(current) or (type(value) is int and type(current) is float)


def _key_types(cfg: K3Config) -> dict[str, tuple[T, T | None]]:
    types = {key: (vtype, sub) for key, _v, vtype, sub in K.model_keys(cfg)}
    types.update((key, (vtype, None)) for key, (_attr, vtype) in TOKENIZER_OVERRIDES.items())
    return types


def _check_one(where: str, key: str, value: Any, meta: Mapping[str, Any], types: Mapping) -> None:
    if key not in meta:
        raise UsageError(f"{where} {key}: the GGUF has no such key")
    if key not in types:
        raise UsageError(f"{where} {key}: not a key this runner reads (the {K.ARCH}.* keys of the key table or "
                         f"{', '.join(TOKENIZER_OVERRIDES)})")
    if not _override_type_matches(value, meta[key]):
        raise UsageError(f"{where} {key}: the file stores a {type(meta[key]).__name__}, "
                         f"the override is a {type(value).__name__}")
    vtype, sub_type = types[key]
    why = value_problem(vtype, value, sub_type)
    if why is not None:
        raise UsageError(f"{where} {key}: {why}")


def _layout(cfg: K3Config) -> list[tuple[str, tuple[int, ...]]]:
    return [(p.name, p.shape) for p in plan_tensors(cfg)]


Rebuild = Callable[[Mapping[str, Any], str], K3Config]


def apply_overrides(meta: Mapping[str, Any], cfg: K3Config, overrides: Mapping[str, Any], where: str,
                    rebuild: Rebuild) -> tuple[dict[str, Any], K3Config]:
    """(metadata, config) with --override-kv applied; `rebuild` is the loader's metadata -> config
    with all its checks. A value may change anything but the tensor layout: the tensors were
    validated against the file's own keys, and a ggml op on a mis-shaped tensor aborts."""
    if not overrides:
        return dict(meta), cfg  # the loader's config stands: nothing to rebuild
    where = f"{where}: --override-kv"
    types = _key_types(cfg)
    new = dict(meta)
    for key, value in overrides.items():
        _check_one(where, key, value, meta, types)
        new[key] = float(value) if type(meta[key]) is float else value
    new_cfg = rebuild(new, where)
    if _layout(new_cfg) != _layout(cfg):
        raise UsageError(f"{where}: {', '.join(overrides)} would change the tensor layout; only values "
                         "that keep every tensor's shape can be overridden")
    return new, new_cfg


def tokenizer_settings(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Tokenizer attribute -> value for the tokenizer keys among the overrides."""
    return {attr: overrides[key] for key, (attr, _t) in TOKENIZER_OVERRIDES.items() if key in overrides}
