"""How to load a model: one options object that every front end builds (the CLI, perplexity,
calibrate, the server, the tests, a Python caller), checked in one place.

    opts = LoadOptions(n_ctx=8192, n_seq=4, exact_experts=True)
    model = Model.load("k3.gguf", opts)

`check()` runs before any file is opened, `resolve()` once the GGUF's metadata is read and before
any ggml object exists: a bad value is one `KimiError` line (exit code 2) naming the option by its
command-line flag, as the runners spell it, never a ggml abort later. Fields are named after
llama.cpp's `common_params` where it has one (`n_ctx`, `n_seq_max` -> `n_seq`, `n_batch`,
`cache_type_k`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import math

import ggml

from gguf_arch.arch.config import K3Config
from gguf_arch.io.console import cpu_count

from ..backends.rpc.relay import DEFAULT_TIMEOUT_S
from ..backends.rpc.wire import parse_endpoints
from ..backends.streaming.budget import parse_size
from ..graph.placement import parse_tensor_split
from ..graph.build import DSA_PATHS
from .inputs import EvalError

# The DSA attention unless asked otherwise: gathering the top_k rows was the faster path on both
# kernels in bench/graph.py (docs/bench/graph.md): attention kernel 0.41-0.96x of masked on the
# fast path, 0.07-0.21x on the exact one at 1k-128k contexts; and in bench/long_context.py at
# K3.1-Pro's widths (docs/bench/long_context.md): decode 0.90x of masked at 128k, the DSA layer's
# prefill 2.2x (8k prompt) and 3.7x (32k) as fast. Only at tiny widths, where flash attention
# over the whole cache is cheap, is a gathered prefill slower (bench/dsa_batches.py).
DEFAULT_DSA_PATH = "gather"
DEFAULT_CTX = 4096  # llama.cpp's -c default

DEFAULT_BATCH = 2048  # llama.cpp's -b: the most prompt tokens one generation step feeds
DEFAULT_UBATCH = 512  # llama.cpp's -ub: the most tokens one graph computes

# Cache types by name (llama.cpp's --cache-type-k spelling) -> ggml type. The latent cache takes
# llama.cpp's -ctk types that this graph's kernels read (q8_0 only where flash attention runs: on
# the fast path; the gathered path dequantizes the rows it reads); the indexer key cache the
# types its matmul reads without a conversion of the keys (the queries are rounded to the type).
CACHE_TYPES = {"f32": ggml.GGML_TYPE_F32, "f16": ggml.GGML_TYPE_F16, "bf16": ggml.GGML_TYPE_BF16,
               "q8_0": ggml.GGML_TYPE_Q8_0}
LATENT_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
INDEXER_CACHE_TYPES = ("f32", "f16", "bf16")
FLASH_ONLY_TYPES = ("q8_0",)  # a quantized latent is read by flash attention, which the exact path does not run
EXACT_CACHE_TYPE = "f32"  # the exact path's caches, both of them
DEFAULT_LATENT_TYPE = "f16"  # llama.cpp's -ctk default
DEFAULT_INDEXER_TYPE = "f16"  # llama.cpp keeps the indexer keys in -ctk's type too


class OptionError(EvalError):
    """A load option the model cannot take (exit code 2)."""


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int = DEFAULT_CTX  # context of all sequences together (0: the model's); each gets n_ctx // n_seq
    n_seq: int = 1  # sequences decoded together (llama.cpp's n_seq_max, -np)
    n_threads: int | None = None  # None: the CPUs this process may use
    n_batch: int = DEFAULT_BATCH  # the most prompt tokens one generation step feeds (-b)
    n_ubatch: int = DEFAULT_UBATCH  # the most tokens one graph computes (-ub; at most n_batch, as llama.cpp)
    exact_experts: bool = False  # the exact path: F32 activations, F32 caches, no flash attention
    dsa: bool | None = None  # the indexer of a K3.1-Pro GGUF: None on if it has one, True required, False off
    dsa_path: str | None = None  # "gather" or "masked" (None: DEFAULT_DSA_PATH)
    top_k: int | None = None  # override the GGUF's indexer top-k
    repack: bool | None = None  # the experts in ggml's repacked layout (None: as llama.cpp decides)
    rpc: Sequence[str] | str = ()  # ggml RPC servers to spread the layers over
    rpc_timeout: float | None = None  # with rpc: the longest wait for one reply, in s (None: DEFAULT_TIMEOUT_S)
    tensor_split: Sequence[float] | str | None = None  # with rpc: each server's share, then the CPU's
    mem_budget: int | str | None = None  # bytes (or "8G", a preset) the model may keep resident
    cache_type_k: str | None = None  # the MLA latent cache (None: f32 exact, DEFAULT_LATENT_TYPE fast)
    cache_type_indexer: str | None = None  # the DSA indexer key cache (None: f32 exact, DEFAULT_INDEXER_TYPE fast)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # --override-kv: GGUF key -> value
    progress: bool = False  # a progress bar while RPC servers receive their weights

    # ---- before the file is opened -------------------------------------------------------------
    def check(self) -> "LoadOptions":
        """Everything that does not need the model; returns self."""
        _positive("-np/--parallel (n_seq)", self.n_seq)
        if self.n_threads is not None:
            _positive("-t/--threads (n_threads)", self.n_threads)
        _positive("-b/--batch-size (n_batch)", self.n_batch)
        _positive("-ub/--ubatch-size (n_ubatch)", self.n_ubatch)
        if isinstance(self.n_ctx, bool) or not isinstance(self.n_ctx, int) or self.n_ctx < 0:
            raise OptionError(f"-c/--ctx-size (n_ctx) must be an integer >= 0 (0: the model's), got {self.n_ctx!r}")
        if self.top_k is not None:
            _positive("top_k", self.top_k)
        if self.dsa_path is not None and self.dsa_path not in DSA_PATHS:
            raise OptionError(f"--dsa-path (dsa_path) must be one of {', '.join(DSA_PATHS)}, got {self.dsa_path!r}")
        self._check_cache_types()
        self._check_placement()
        return self

    def _check_cache_types(self) -> None:
        for flag, name, allowed in (("--cache-type-k", self.cache_type_k, LATENT_CACHE_TYPES),
                                    ("--cache-type-indexer", self.cache_type_indexer, INDEXER_CACHE_TYPES)):
            if name is None:
                continue
            if name not in allowed:
                raise OptionError(f"{flag} {name!r}: expected one of {', '.join(allowed)}")
            if self.exact_experts and name != EXACT_CACHE_TYPE:
                why = " (q8_0 is read by flash attention, which the exact path does not run)" \
                    if name in FLASH_ONLY_TYPES else ""
                raise OptionError(f"{flag} {name}: the exact path (--exact-experts) keeps {EXACT_CACHE_TYPE} "
                                  f"caches{why}; drop {flag} or --exact-experts")

    def _check_placement(self) -> None:
        if self.repack and self.exact_experts:
            raise OptionError("--repack applies to the fast path, not with --exact-experts")
        if self.tensor_split is not None and not self.rpc:
            raise OptionError("--tensor-split needs --rpc")
        self._check_rpc()
        if self.repack and self.rpc:
            raise OptionError("--repack applies to this host's weights only, not with --rpc")
        if self.mem_budget is not None:
            parse_size(self.mem_budget)  # a bad SIZE is one line before the model is opened
            if self.rpc or self.repack:
                raise OptionError("--mem-budget streams this host's mapped layers; not with --rpc or --repack")

    def _check_rpc(self) -> None:
        """--rpc's endpoints, -ts's shares (one per server and the CPU) and --rpc-timeout, before any
        connection is made."""
        if self.rpc_timeout is not None:
            if not self.rpc:
                raise OptionError("--rpc-timeout needs --rpc")
            if isinstance(self.rpc_timeout, bool) or not isinstance(self.rpc_timeout, (int, float)) \
                    or not 0 < self.rpc_timeout < math.inf:
                raise OptionError(f"--rpc-timeout must be a positive number of seconds (rpc_timeout), "
                                  f"got {self.rpc_timeout!r}")
        if self.rpc:
            n = len(parse_endpoints(self.rpc))
            if self.tensor_split is not None:
                split = self.tensor_split
                parse_tensor_split(split if isinstance(split, str) else ",".join(map(str, split)), n + 1)

    @property
    def reply_timeout(self) -> float:
        """The longest wait for one reply of an RPC server, in seconds."""
        return DEFAULT_TIMEOUT_S if self.rpc_timeout is None else float(self.rpc_timeout)

    # ---- once the metadata is read ---------------------------------------------------------------
    def resolve(self, cfg: K3Config, where: str) -> "LoadOptions":
        """The options with the model's defaults filled in (n_ctx 0, threads, DSA path), checked
        against the model (`where` names the file in messages)."""
        n_ctx = cfg.context_length * self.n_seq if self.n_ctx == 0 else self.n_ctx
        if self.n_seq == 1 and n_ctx > cfg.context_length:
            raise OptionError(f"-c {self.n_ctx} exceeds the model's context length {cfg.context_length}")
        if not 1 <= n_ctx // self.n_seq <= cfg.context_length:
            raise OptionError(f"-c {n_ctx} over -np {self.n_seq} sequences gives each {n_ctx // self.n_seq} tokens; "
                              f"expected 1..{cfg.context_length} (the model's context length)")
        has_indexer = cfg.indexer is not None
        if self.dsa and not has_indexer:
            raise OptionError(f"{where}: --dsa on: the GGUF has no DSA indexer (a plain kimi-k3 file); drop --dsa")
        if self.top_k is not None and not has_indexer:
            raise OptionError(f"{where}: top_k given, but the GGUF has no DSA indexer")
        if self.dsa_path is not None and (not has_indexer or self.dsa is False):
            why = "the GGUF has no DSA indexer" if not has_indexer else "--dsa off runs dense attention"
            raise OptionError(f"{where}: --dsa-path {self.dsa_path}: {why}, so no DSA path is taken; drop --dsa-path")
        self._check_block_rows(cfg, where)
        return replace(self, n_ctx=n_ctx, n_threads=self.n_threads or cpu_count(),
                       dsa=has_indexer if self.dsa is None else self.dsa, dsa_path=self.dsa_path or DEFAULT_DSA_PATH)

    def _check_block_rows(self, cfg: K3Config, where: str) -> None:
        """A block-quantized latent cache needs whole blocks in a row and in its value part."""
        name = self.cache_types()["latent"]
        block = ggml.ggml_blck_size(CACHE_TYPES[name])
        widths = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank)
        if any(w % block for w in widths):
            raise OptionError(f"{where}: --cache-type-k {name} stores blocks of {block} values; this model's latent "
                              f"rows ({widths[0]} values, of which {widths[1]} the value) are not whole blocks")

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def n_ctx_seq(self) -> int:
        """Cache rows of each sequence (after resolve)."""
        return self.n_ctx // self.n_seq

    @property
    def n_ubatch_eff(self) -> int:
        """Tokens one graph computes at most: n_ubatch, at most n_batch (llama.cpp's rule)."""
        return min(self.n_batch, self.n_ubatch)

    def cache_types(self) -> dict[str, str]:
        """The caches' types by name, as a state file records them."""
        exact = EXACT_CACHE_TYPE if self.exact_experts else None
        return {"latent": self.cache_type_k or exact or DEFAULT_LATENT_TYPE,
                "indexer": self.cache_type_indexer or exact or DEFAULT_INDEXER_TYPE}

    def latent_type(self) -> int:
        return CACHE_TYPES[self.cache_types()["latent"]]

    def indexer_type(self) -> int:
        return CACHE_TYPES[self.cache_types()["indexer"]]


def _positive(option: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{option} must be an integer >= 1, got {value!r}")

