"""The runtime options every runner takes (kimi-k3-cli, kimi-k3-server, the tools), as llama.cpp
names them, and the LoadOptions they make: the one place a command line becomes load options."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gguf_arch.io.console import UsageError

from ..backends.rpc.relay import DEFAULT_TIMEOUT_S
from ..backends.streaming.budget import PRESETS
from ..engine.options import (DEFAULT_BATCH, DEFAULT_INDEXER_TYPE, DEFAULT_LATENT_TYPE, DEFAULT_UBATCH,
                              INDEXER_CACHE_TYPES, LATENT_CACHE_TYPES, LoadOptions)
from ..graph.build import DSA_PATHS


def _parse_bool(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError("bool is 'true' or 'false'")
    return text == "true"


_OVERRIDE_TYPES = {"int": int, "float": float, "bool": _parse_bool, "str": str}


def parse_override_kv(spec: str) -> tuple[str, Any]:
    """`KEY=TYPE:VALUE` (llama.cpp's syntax, TYPE int|float|bool|str) -> (KEY, typed value)."""
    key, eq, rest = spec.partition("=")
    kind, colon, text = rest.partition(":")
    if not (key and eq and colon) or kind not in _OVERRIDE_TYPES:
        raise UsageError(f"--override-kv {spec!r}: expected KEY=TYPE:VALUE with TYPE one of "
                         f"{', '.join(_OVERRIDE_TYPES)}")
    try:
        return key, _OVERRIDE_TYPES[kind](text)
    except ValueError as exc:
        raise UsageError(f"--override-kv {spec!r}: {text!r} is not a {kind} ({exc})") from None


def _overrides(specs: str) -> list[tuple[str, Any]]:
    # Several KEY=TYPE:VALUE separated by commas, as llama.cpp splits them (a str value holds none).
    try:
        return [parse_override_kv(spec) for spec in specs.split(",")]
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--override-kv ")) from None


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=Path, required=True,
                   help="kimi-k3 GGUF (a split GGUF: its first file, *-00001-of-0000N.gguf)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--override-kv, --dsa, --dsa-path, --exact-experts, --repack / -nr."""
    p.add_argument("--override-kv", type=_overrides, action="extend", default=[], metavar="KEY=TYPE:VALUE[,...]",
                   help="override GGUF metadata values, e.g. kimi-k3.attention.indexer.top_k=int:64; several separated "
                        "by commas, as llama.cpp takes them (repeatable)")
    p.add_argument("--dsa", choices=("on", "off"), default=None,
                   help="run the DSA indexer of a K3.1-Pro GGUF (default: on; off: dense MLA attention)")
    p.add_argument("--dsa-path", choices=DSA_PATHS, default=None,
                   help="DSA attention: gather = over only the top_k selected cache rows per query, masked = over "
                        "the whole cache with the selection as a mask (same logits to rounding; default: gather, "
                        "the faster one)")
    p.add_argument("--exact-experts", action="store_true",
                   help="exact path: F32 activations in every matmul, F32 caches, no flash attention")
    p.add_argument("--repack", action="store_true", default=None,
                   help="copy the routed experts into ggml's repacked MXFP4 layout (faster MoE matmuls, anonymous "
                        "memory the size of the experts; fast path only). Default, as llama.cpp: on when the "
                        "GGUF fits in memory and neither --exact-experts, --rpc nor --mem-budget is given")
    p.add_argument("-nr", "--no-repack", dest="repack", action="store_false",
                   help="keep every weight in the mapped file, no copy")


def add_context_arguments(p: argparse.ArgumentParser) -> None:
    """-b / -ub and the cache types, as llama.cpp names them (docs/long-context.md)."""
    p.add_argument("-b", "--batch-size", type=int, default=DEFAULT_BATCH, metavar="N",
                   help=f"the most prompt tokens fed to the model at once (default {DEFAULT_BATCH})")
    p.add_argument("-ub", "--ubatch-size", type=int, default=DEFAULT_UBATCH, metavar="N",
                   help=f"the most tokens one graph computes, at most -b: bounds the memory of a long prompt "
                        f"(default {DEFAULT_UBATCH})")
    p.add_argument("-ctk", "--cache-type-k", default=None, metavar="TYPE",
                   help=f"the MLA latent cache's type: {', '.join(LATENT_CACHE_TYPES)} (default {DEFAULT_LATENT_TYPE}; "
                        "f32 with --exact-experts, which takes no other; q8_0 needs flash attention: not with "
                        "--exact-experts)")
    p.add_argument("--cache-type-indexer", default=None, metavar="TYPE",
                   help=f"the DSA indexer key cache's type: {', '.join(INDEXER_CACHE_TYPES)} (default "
                        f"{DEFAULT_INDEXER_TYPE}; f32 with --exact-experts)")


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    """--rpc, --rpc-timeout, -ts, --mem-budget."""
    p.add_argument("--rpc", metavar="HOST:PORT[,...]", default=None,
                   help="spread the layers over these ggml RPC servers (started with kimi-k3-rpc-server) and "
                        "this host")
    p.add_argument("--rpc-timeout", metavar="S", type=float, default=None,
                   help=f"with --rpc: the longest wait for any one reply of a server, its graph's computation "
                        f"included, in seconds (default {DEFAULT_TIMEOUT_S:g}); past it the run ends with exit 1")
    p.add_argument("-ts", "--tensor-split", metavar="N0,N1,...", default=None,
                   help="with --rpc: the share of the layers of each server, in --rpc order, then of this host "
                        "(missing values are 0; default: each one's free memory)")
    p.add_argument("--mem-budget", metavar="SIZE", default=None,
                   help=f"keep at most SIZE resident (512M, 8G, or {', '.join(PRESETS)}); layers that do not "
                        "fit are read from the file per token")


def load_options(a: argparse.Namespace, **fields) -> LoadOptions:
    """The LoadOptions of a runner's parsed arguments (`fields`: what the runner sets itself,
    such as n_seq, over what was parsed), checked (LoadOptions.check)."""
    parsed = dict(n_ctx=a.ctx_size, n_threads=a.threads, exact_experts=a.exact_experts, n_batch=a.batch_size,
                  n_ubatch=a.ubatch_size, cache_type_k=a.cache_type_k, cache_type_indexer=a.cache_type_indexer,
                  dsa=None if a.dsa is None else a.dsa == "on", dsa_path=a.dsa_path, repack=a.repack,
                  rpc=a.rpc or (), rpc_timeout=a.rpc_timeout, tensor_split=a.tensor_split, mem_budget=a.mem_budget,
                  overrides=dict(a.override_kv))
    return LoadOptions(**{**parsed, **fields}).check()
