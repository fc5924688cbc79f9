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

import ggml

from gguf_arch.arch.config import K3Config
from gguf_arch.io.console import cpu_count

from ..backends.streaming.budget import parse_size
from ..graph.build import DSA_PATHS
from .inputs import EvalError

# The DSA attention unless asked otherwise: gathering the top_k rows was the faster path on both
# kernels in bench/graph.py (docs/bench/graph.md): attention kernel 0.41-0.96x of masked on the
# fast path, 0.07-0.21x on the exact one at 1k-128k contexts; whole-model decode 0.90-0.99x at
# 1k-8k. Prefill is its cost: equal on that model's 512-token prompt, 13% slower on the tiny
# model's 2k-8k prompts (bench/dsa_batches.py).
DEFAULT_DSA_PATH = "gather"
DEFAULT_CTX = 4096  # llama.cpp's -c default

# Cache types by name (llama.cpp's --cache-type-k spelling) -> ggml type.
CACHE_TYPES = {"f32": ggml.GGML_TYPE_F32, "f16": ggml.GGML_TYPE_F16, "bf16": ggml.GGML_TYPE_BF16}
INDEXER_CACHE_TYPES = ("f32",)
LATENT_CACHE_TYPES = ("f32", "f16")


class OptionError(EvalError):
    """A load option the model cannot take (exit code 2)."""


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int = DEFAULT_CTX  # context of all sequences together (0: the model's); each gets n_ctx // n_seq
    n_seq: int = 1  # sequences decoded together (llama.cpp's n_seq_max, -np)
    n_threads: int | None = None  # None: the CPUs this process may use
    n_batch: int | None = None  # the most tokens one graph computes (None: a whole call at once)
    exact_experts: bool = False  # the exact path: F32 activations, F32 caches, no flash attention
    dsa: bool | None = None  # the indexer of a K3.1-Pro GGUF: None on if it has one, True required, False off
    dsa_path: str | None = None  # "gather" or "masked" (None: DEFAULT_DSA_PATH)
    top_k: int | None = None  # override the GGUF's indexer top-k
    repack: bool | None = None  # the experts in ggml's repacked layout (None: as llama.cpp decides)
    rpc: Sequence[str] | str = ()  # ggml RPC servers to spread the layers over
    tensor_split: Sequence[float] | str | None = None  # with rpc: each server's share, then the CPU's
    mem_budget: int | str | None = None  # bytes (or "8G", a preset) the model may keep resident
    cache_type_k: str | None = None  # the MLA latent cache (None: f32 exact, f16 fast)
    cache_type_indexer: str = "f32"  # the DSA indexer key cache
    overrides: Mapping[str, Any] = field(default_factory=dict)  # --override-kv: GGUF key -> value
    progress: bool = False  # a progress bar while RPC servers receive their weights

    # ---- before the file is opened -------------------------------------------------------------
    def check(self) -> "LoadOptions":
        """Everything that does not need the model; returns self."""
        _positive("-np/--parallel (n_seq)", self.n_seq)
        if self.n_threads is not None:
            _positive("-t/--threads (n_threads)", self.n_threads)
        if self.n_batch is not None:
            _positive("-b/--batch-size (n_batch)", self.n_batch)
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
        allowed = ("f32",) if self.exact_experts else LATENT_CACHE_TYPES
        if self.cache_type_k is not None and self.cache_type_k not in allowed:
            why = "the exact path keeps F32 caches" if self.exact_experts else "the latent cache types"
            raise OptionError(f"--cache-type-k {self.cache_type_k}: expected one of {', '.join(allowed)} ({why})")
        allowed = ("f32",) if self.exact_experts else INDEXER_CACHE_TYPES
        if self.cache_type_indexer not in allowed:
            raise OptionError(f"--cache-type-indexer {self.cache_type_indexer}: expected one of {', '.join(allowed)}")

    def _check_placement(self) -> None:
        if self.repack and self.exact_experts:
            raise OptionError("--repack applies to the fast path, not with --exact-experts")
        if self.tensor_split is not None and not self.rpc:
            raise OptionError("--tensor-split needs --rpc")
        if self.repack and self.rpc:
            raise OptionError("--repack applies to this host's weights only, not with --rpc")
        if self.mem_budget is not None:
            parse_size(self.mem_budget)  # a bad SIZE is one line before the model is opened
            if self.rpc or self.repack:
                raise OptionError("--mem-budget streams this host's mapped layers; not with --rpc or --repack")

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
        return replace(self, n_ctx=n_ctx, n_threads=self.n_threads or cpu_count(),
                       dsa=has_indexer if self.dsa is None else self.dsa, dsa_path=self.dsa_path or DEFAULT_DSA_PATH)

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def n_ctx_seq(self) -> int:
        """Cache rows of each sequence (after resolve)."""
        return self.n_ctx // self.n_seq

    def latent_type(self) -> int:
        name = self.cache_type_k or ("f32" if self.exact_experts else "f16")
        return CACHE_TYPES[name]

    def indexer_type(self) -> int:
        return CACHE_TYPES[self.cache_type_indexer]

    def cache_types(self) -> dict[str, str]:
        """The caches' types by name, as a state file records them."""
        return {"latent": self.cache_type_k or ("f32" if self.exact_experts else "f16"),
                "indexer": self.cache_type_indexer}


def _positive(option: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{option} must be an integer >= 1, got {value!r}")

