"""Everything the runner's command line asks for, checked before any ggml object exists.

A value ggml cannot take aborts the whole process (GGML_ASSERT, SIGABRT) and a value numpy cannot
take ends in a traceback ("Probabilities contain NaN" for --min-p 2, ZeroDivisionError for
--chunks 0 or an indexer top_k of 0), so each option and each --override-kv value is checked here
against what it becomes, with one `error:` line and exit 2:

* sampling and run options (`check_options`): their ranges, finite floats, and -t capped at the
  CPUs this process may use (more threads than cores only make each token slower);
* --override-kv (`apply_overrides`): the key must be one this runner reads, the value of the
  file's type and within what the key's GGUF type holds (a uint32 is never negative), and the
  config rebuilt from the overridden keys passes the loader's own checks (ranges included) and
  keeps every tensor's shape. The loader calls it before it maps a byte (`load_gguf(adjust=...)`).
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Mapping

from gguf import GGUFValueType as T
from gguf import Keys

from gguf_arch.arch import keys as K
from gguf_arch.arch.config import K3Config
from gguf_arch.arch.tensors import plan_tensors
from gguf_arch.io.console import UsageError, cpu_count
from gguf_arch.io.gguf_values import problem as value_problem

from ..backends.rpc.wire import parse_endpoints
from ..backends.streaming.budget import parse_size
from ..generation.perplexity import MIN_PERPLEXITY_CTX
from ..graph.placement import parse_tensor_split
from .chat import check_chat_options

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: draw a seed; the largest 32-bit seed
# The tokenizer keys an override may change, with the tokenizer attribute each sets; gguf-py
# writes the ids as uint32 and the flag as a bool.
TOKENIZER_OVERRIDES = {Keys.Tokenizer.BOS_ID: ("bos_id", T.UINT32), Keys.Tokenizer.EOS_ID: ("eos_id", T.UINT32),
                       Keys.Tokenizer.ADD_BOS: ("add_bos", T.BOOL)}


# (option, attribute, lowest, highest or None); floats must also be finite. --temp <= 0 is greedy,
# as in llama.cpp, so it has no lower bound.
_RANGES = (("-c/--ctx-size", "ctx_size", 0, None), ("-n/--n-predict", "n_predict", -1, None),
           ("--temp", "temp", -math.inf, None), ("--top-k", "top_k", 0, None), ("--top-p", "top_p", 0.0, 1.0),
           ("--min-p", "min_p", 0.0, 1.0), ("--repeat-penalty", "repeat_penalty", -math.inf, None),
           ("--repeat-last-n", "repeat_last_n", -1, None), ("-s/--seed", "seed", -1, None))


def _check_range(option: str, value: Any, low: float, high: float | None) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{option} must be a finite number, got {value}")
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise UsageError(f"{option} must be {span}, got {value}")


def check_options(a: argparse.Namespace) -> list[str]:
    """Raise UsageError for the first bad option; returns notes to print (-t capped)."""
    if a.perplexity and a.file is None:
        raise UsageError("--perplexity needs -f FILE")
    for option, attr, low, high in _RANGES:
        _check_range(option, getattr(a, attr), low, high)
    if a.chunks != -1 and a.chunks < 1:
        raise UsageError(f"--chunks must be -1 (all) or >= 1, got {a.chunks}")
    if a.chunks != -1 and not a.perplexity:
        raise UsageError("--chunks applies to --perplexity only")
    if not a.repeat_penalty > 0:
        raise UsageError(f"--repeat-penalty must be > 0, got {a.repeat_penalty} (1.0 = off)")
    if a.seed > RANDOM_SEED:
        raise UsageError(f"-s/--seed must be at most {RANDOM_SEED} (a 32-bit seed, as llama.cpp's), got {a.seed}")
    if a.repack and a.exact_experts:
        raise UsageError("--repack applies to the fast path, not with --exact-experts")
    if a.tensor_split is not None and a.rpc is None:
        raise UsageError("--tensor-split needs --rpc")
    if a.rpc_timeout is not None and (a.rpc is None or not 0 < a.rpc_timeout < math.inf):
        raise UsageError("--rpc-timeout needs --rpc" if a.rpc is None else
                         f"--rpc-timeout must be a positive number of seconds, got {a.rpc_timeout}")
    if a.repack and a.rpc is not None:
        raise UsageError("--repack applies to this host's weights only, not with --rpc")
    if a.mem_budget is not None:
        parse_size(a.mem_budget)  # a bad SIZE is one line before the model is opened
        if a.rpc is not None or a.repack:
            raise UsageError("--mem-budget streams this host's mapped layers; not with --rpc or --repack")
    _check_late_options(a)
    return _cap_threads(a)


def _check_late_options(a: argparse.Namespace) -> None:
    """What the load and the run would otherwise find only once the model is loaded."""
    if a.rpc is not None:
        endpoints = parse_endpoints(a.rpc)
        if a.tensor_split is not None:
            parse_tensor_split(a.tensor_split, len(endpoints) + 1)
    if a.perplexity and 0 < a.ctx_size < MIN_PERPLEXITY_CTX:
        raise UsageError(f"--perplexity: -c {a.ctx_size} is too small: the scored half of a chunk needs "
                         f"-c {MIN_PERPLEXITY_CTX} or more")
    check_chat_options(a)


def _cap_threads(a: argparse.Namespace) -> list[str]:
    cpus = cpu_count()
    if a.threads is None:
        a.threads = cpus
        return []
    if a.threads < 1:
        raise UsageError(f"-t/--threads must be >= 1, got {a.threads}")
    if a.threads > cpus:
        note = f"note: -t {a.threads} is more than the {cpus} CPU(s) this process may use; using {cpus}"
        a.threads = cpus
        return [note]
    return []


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


def check_dsa(dsa: str | None, dsa_path: str | None, cfg: K3Config, where: str) -> None:
    """--dsa on and --dsa-path mean something only with a DSA indexer that runs."""
    if cfg.indexer is None and dsa == "on":
        raise UsageError(f"{where}: --dsa on: the GGUF has no DSA indexer (a plain kimi-k3 file); drop --dsa")
    if dsa_path is not None and (cfg.indexer is None or dsa == "off"):
        why = "the GGUF has no DSA indexer" if cfg.indexer is None else "--dsa off runs dense attention"
        raise UsageError(f"{where}: --dsa-path {dsa_path}: {why}, so no DSA path is taken; drop --dsa-path")


def tokenizer_settings(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Tokenizer attribute -> value for the tokenizer keys among the overrides."""
    return {attr: overrides[key] for key, (attr, _t) in TOKENIZER_OVERRIDES.items() if key in overrides}
