"""Kimi K3 / K3.1-Pro forward pass on a ggml graph: the API the runner and the tests use.

    m = Model.load("k3.gguf", n_ctx=4096, exact_experts=False, dsa=True, top_k=None)
    logits = m.eval(tokens)          # [n_tokens, vocab], appended to the sequence's caches
    m.reset()

Each call builds the graph for its token count (the weights are never touched: they stay in the
memory-mapped file), places it with one ggml-alloc allocator that keeps its buffer from call to
call (it only grows when a call needs more), and computes it on the CPU backend.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from gguf_arch.errors import KimiError
from gguf_arch.io.console import cpu_count

from ..backends.cpu import Executor
from ..backends.rpc.devices import Devices
from ..backends.streaming.budget import parse_size
from ..backends.streaming.executor import StreamingExecutor
from ..blocks.forward import build_forward, graph_size
from ..graph import taps
from ..graph.build import DSA_PATHS, I32, GraphBuild
from ..graph.cache import SequenceCache
from ..weights.loader import GGUFWeights, load_gguf
from ..weights.repack import resolve_repack

# The DSA attention unless asked otherwise: gathering the top_k rows was the faster path on both
# kernels in bench/graph.py, on AVX2 (attention kernel 0.41-0.96x of masked on the fast path,
# 0.07-0.21x on the exact one, 1k-128k contexts; whole-model decode 0.66x / 0.57x at 128k) and
# on AVX512-BF16 (decode 0.90-0.99x at 1k-8k; README, issue 19). Prefill is its
# cost: equal on that model's 512-token prompt, 13% slower on the tiny model's 2k-8k prompts
# (bench/dsa_batches.py).
DEFAULT_DSA_PATH = "gather"


WANTS = frozenset({"hidden", "index_selected", "index_scores", "moe", taps.MOE_NORMS, taps.IMATRIX})


class EvalError(KimiError):
    """A request the loaded model cannot serve (token ids, context length, options)."""


@dataclass
class EvalResult:
    """One call's outputs; everything but `logits` only when asked for with `want`."""

    logits: np.ndarray  # [n_tokens, vocab]
    hidden: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, n_embd]
    index_selected: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, k]
    index_scores: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, n_kv]
    moe_experts: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, k], ascending
    moe_weights: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, k], same order
    moe_norms: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [n_tokens, k], same order (taps.py)
    # weight name -> sum over the call's tokens of its input squared, [n_mat, ne0] (taps.py)
    imatrix: dict[str, np.ndarray] = field(default_factory=dict)


# Padding when joining per-batch rows of different widths (the visible context grows).
_JOIN_FILL = {"index_selected": -1, "index_scores": -np.inf}


def _join(parts: list[EvalResult]) -> EvalResult:
    """Per-batch results as one: rows concatenated, short rows padded (-1 / -inf)."""
    out = EvalResult(np.concatenate([p.logits for p in parts]))
    out.imatrix = {name: sum(p.imatrix[name] for p in parts) for name in parts[0].imatrix}
    for name in ("hidden", "index_selected", "index_scores", "moe_experts", "moe_weights", "moe_norms"):
        for layer in getattr(parts[0], name):
            rows = [getattr(p, name)[layer] for p in parts]
            width = max(r.shape[1] for r in rows)
            fill = _JOIN_FILL.get(name, 0)
            getattr(out, name)[layer] = np.concatenate(
                [np.pad(r, ((0, 0), (0, width - r.shape[1])), constant_values=fill) for r in rows])
    return out


def _fixture_selection(sel: np.ndarray, n_past: int, width: int) -> np.ndarray:
    """Rows of selected positions -> visible ones only, ascending, padded with -1 to `width`."""
    out = np.full((sel.shape[0], width), -1, dtype=np.int32)
    for t, row in enumerate(sel):
        kept = np.sort(row[row <= n_past + t])
        out[t, :len(kept)] = kept
    return out


class Model:
    """A loaded GGUF plus one sequence's caches. Not thread-safe; one sequence at a time."""

    def __init__(self, weights: GGUFWeights, *, n_ctx: int, exact: bool, dsa: bool,
                 top_k: int | None, n_threads: int, n_batch: int | None = None, dsa_path: str | None = None,
                 rpc: str | Sequence[str] = (), tensor_split: str | Sequence[float] | None = None,
                 progress: bool = False, mem_budget: int | str | None = None):
        if exact and weights.repacked:
            raise EvalError(f"{weights.path}: the exact path dequantizes the experts from the file's layout; "
                            "load the GGUF without repack for it")
        self.weights = weights
        self.cfg = weights.cfg
        self.exact = exact
        self.dsa = dsa
        self._top_k: int | None = None
        self.top_k = top_k  # validated before any ggml object exists
        for name, value in (("n_threads", n_threads), ("n_batch", 1 if n_batch is None else n_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EvalError(f"{name} must be an integer >= 1, got {value!r}")
        self.n_batch = n_batch
        dsa_path = DEFAULT_DSA_PATH if dsa_path is None else dsa_path
        if dsa_path not in DSA_PATHS:
            raise EvalError(f"dsa_path must be one of {', '.join(DSA_PATHS)}, got {dsa_path!r}")
        self.dsa_path = dsa_path
        self._graph_size = graph_size(weights)
        self.devices = self._connect(rpc, tensor_split, n_threads, progress)
        try:
            self._exec = self._executor(n_threads, mem_budget)
            self.cache = SequenceCache(self.cfg, self._exec.backend, n_ctx=n_ctx, exact=exact,
                                       with_indexer=dsa and self.cfg.indexer is not None,
                                       layer_backends=self.devices and self.devices.layer_backends(self._exec.backend))
        except BaseException:
            if self.devices is not None:
                self.devices.close()
            raise
        if isinstance(self._exec, StreamingExecutor):
            self._exec.attach(self.cache.nbytes(self._exec.backend))

    def _executor(self, n_threads: int, mem_budget: int | str | None) -> Executor:
        """CPU, CPU within a memory budget (backends/streaming/executor.py), or the RPC devices' scheduler."""
        if mem_budget is None:
            return Executor(n_threads) if self.devices is None else self.devices.executor(self._graph_size)
        budget = parse_size(mem_budget)
        if self.devices is not None or self.weights.repacked:
            raise EvalError("mem_budget streams the mapped layers on this host: not with rpc or repack")
        return StreamingExecutor(self.weights, budget, n_threads, exact=self.exact)

    def _connect(self, rpc, tensor_split, n_threads: int, progress: bool) -> Devices | None:
        """The RPC servers with their layers uploaded (None: everything on the local CPU)."""
        if not rpc:
            if tensor_split is not None:
                raise EvalError("tensor_split places layers over RPC servers; give rpc too")
            return None
        if self.weights.repacked:
            raise EvalError(f"{self.weights.path}: repacked experts stay on this host; load without repack for rpc")
        return Devices.connect(self.weights, rpc, tensor_split=tensor_split, n_threads=n_threads, progress=progress)

    @classmethod
    def load(cls, path: Path | str, *, n_ctx: int, exact_experts: bool = False, dsa: bool = True,
             top_k: int | None = None, n_threads: int | None = None, n_batch: int | None = None,
             dsa_path: str | None = None, repack: bool | None = None, rpc: str | Sequence[str] = (),
             tensor_split: str | Sequence[float] | None = None, progress: bool = False,
             mem_budget: int | str | None = None) -> "Model":
        """Open and validate a kimi-k3 GGUF.

        exact_experts: the exact path (selected experts dequantized to F32, F32 caches, no f16,
        F32 activations in every matmul), which matches Moonshot's reference to fp32 noise; the
        default fast path runs the MXFP4 experts as llama.cpp does. dsa: run the indexer of a
        K3.1-Pro GGUF (False: dense MLA). top_k: override the GGUF's indexer top-k. n_batch:
        the most tokens one graph computes (None: a whole call at once); the exact path's expert
        scratch grows with it (3 x k experts x n_tokens dequantized F32 matrices per MoE layer).
        dsa_path: "gather" attends over only the top_k selected cache rows of each query, "masked"
        over the whole cache with the selection as a mask (same logits to f32 rounding);
        None: DEFAULT_DSA_PATH. repack: the routed experts in ggml's repacked
        layout (faster MoE matmuls, anonymous memory the size of the experts; fast path only);
        None, the default: as llama.cpp, where the whole GGUF fits in memory, on the fast path
        without rpc or mem_budget (repack.resolve_repack and choose_repack).
        rpc: ggml RPC servers ("host:port", started with kimi-k3-rpc-server) to spread the layers
        over, with the local CPU last; tensor_split: one proportion per server then the CPU
        (default: their free memory), see backends/rpc/devices.py. A server unreachable at load is an RpcError;
        one lost between calls is an RpcError from the next call; one lost during a call ends the
        process with one line and exit code 1 (ggml's RPC client aborts otherwise; backends/rpc/wire.py).
        progress: a progress bar on stderr while the servers' weights are uploaded.
        mem_budget: bytes (or "8G", a preset: backends/streaming/budget.py) the model may keep resident; the
        layers that do not fit are read from the file per token (backends/streaming/executor.py).
        """
        if repack and exact_experts:
            raise EvalError("repack applies to the fast path; the exact path reads the experts from the file")
        weights = load_gguf(path, repack=resolve_repack(repack, exact=exact_experts, rpc=bool(rpc),
                                                        mem_budget=mem_budget is not None))
        if not 1 <= n_ctx <= weights.cfg.context_length:
            weights.close()
            raise EvalError(f"{path}: n_ctx must be in 1..{weights.cfg.context_length}, got {n_ctx}")
        try:
            return cls(weights, n_ctx=n_ctx, exact=exact_experts, dsa=dsa, top_k=top_k,
                       n_threads=cpu_count() if n_threads is None else n_threads, n_batch=n_batch,
                       dsa_path=dsa_path, rpc=rpc, tensor_split=tensor_split, progress=progress,
                       mem_budget=mem_budget)
        except BaseException:
            weights.close()
            raise

    # ---- settings ----------------------------------------------------------------------------
    @property
    def top_k(self) -> int | None:
        """The indexer top-k in use (None: DSA off or a plain K3 GGUF)."""
        if not self.dsa or self.cfg.indexer is None:
            return None
        return self._top_k if self._top_k is not None else self.cfg.indexer.top_k

    @top_k.setter
    def top_k(self, value: int | None) -> None:
        if value is not None:
            if self.cfg.indexer is None:
                raise EvalError(f"{self.weights.path}: top_k given, but the GGUF has no DSA indexer")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EvalError(f"top_k must be an integer >= 1, got {value!r}")
        self._top_k = value

    @property
    def n_past(self) -> int:
        return self.cache.n_past

    @property
    def n_ctx(self) -> int:
        return self.cache.n_ctx

    @property
    def executor(self) -> Executor:
        """What runs the graphs: the CPU executor, or ggml's scheduler over the RPC devices."""
        return self._exec

    # ---- running -----------------------------------------------------------------------------
    def reset(self) -> None:
        if self.devices is not None:
            self.devices.check("before a reset")
        self.cache.reset()

    def eval(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [n_tokens, vocab] for `tokens`, which are appended to the sequence.

        A NaN or infinite logit is an error, never a sampled token or a perplexity of nan: finite
        weights and metadata values can still overflow f32 inside the graph (an expert weight scale
        of 1e38 given by --override-kv)."""
        logits = self.run(tokens).logits
        bad = np.argwhere(~np.isfinite(logits))
        if bad.size:
            i, j = (int(x) for x in bad[0])
            raise EvalError(f"{self.weights.path}: the model computed a non-finite logit ({logits[i, j]}) for token "
                            f"{i} of the batch, vocabulary id {j}: a weight or metadata value (--override-kv?) "
                            "overflows float32 in the graph")
        return logits

    def run(self, tokens: Sequence[int], want: Iterable[str] = ()) -> EvalResult:
        """Like eval, with extra outputs: any of WANTS ("moe_norms" and "imatrix": taps.py).

        With n_batch set, the tokens go through the graph n_batch at a time (the caches make
        that the same computation); the results are joined as if computed in one call.
        """
        want = frozenset(want)
        if taps.MOE_NORMS in want:  # reported in the order of moe_experts, which sorts them
            want |= {"moe"}
        ids = self._check_tokens(tokens, want)
        step = self.n_batch or len(ids)
        parts = [self._run_batch(ids[i:i + step], want) for i in range(0, len(ids), step)]
        return parts[0] if len(parts) == 1 else _join(parts)

    def _run_batch(self, ids: np.ndarray, want: frozenset) -> EvalResult:
        make = partial(GraphBuild, cfg=self.cfg, cache=self.cache, n_tokens=len(ids), exact=self.exact,
                       top_k=self.top_k, wants=want, dsa_path=self.dsa_path, segments=self._exec.segments,
                       bind_experts=self._exec.bind_experts, predict_experts=self._exec.predict_experts)
        size = self._graph_size + (taps.NODES_PER_LAYER * self.cfg.num_layers if want & taps.WANTS else 0)
        if want or self._exec.wants_plan:  # a fresh memory plan (Executor.plan and wants_plan say why)
            with self._exec.graph(size, make) as g:
                self._exec.plan(g, [build_forward(g, self.weights, g.input("tokens", I32, (len(ids),), ids))])
        with self._exec.graph(size, make) as g:
            logits = build_forward(g, self.weights, g.input("tokens", I32, (len(ids),), ids))
            self._exec.compute(g, [logits])
            result = self._collect(g, logits)
        self.cache.n_past += len(ids)
        return result

    def _check_tokens(self, tokens: Sequence[int], want: frozenset) -> np.ndarray:
        unknown = sorted(want - WANTS)
        if unknown:
            raise EvalError(f"unknown output(s) {unknown}; available: {sorted(WANTS)}")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise EvalError("no tokens to evaluate")
        bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
        if bad.size:
            raise EvalError(f"token id {int(bad[0])} is outside the vocabulary 0..{self.cfg.vocab_size - 1}")
        if self.n_past + ids.size > self.n_ctx:
            raise EvalError(f"context full: {self.n_past} cached + {ids.size} new tokens > n_ctx {self.n_ctx}")
        return ids.astype(np.int32)

    def _collect(self, g: GraphBuild, logits) -> EvalResult:
        r = EvalResult(self._exec.read(logits))
        for (what, layer), t in g.records.items():
            a = self._exec.read(t)
            if what == "hidden":
                r.hidden[layer] = a
            elif what == "index_scores":
                r.index_scores[layer] = a
            elif what == "index_selected":
                r.index_selected[layer] = _fixture_selection(a, g.n_past, a.shape[-1])
            elif what == "moe_experts":
                r.moe_experts[layer] = a
            elif what == "moe_weights":
                r.moe_weights[layer] = a.reshape(g.n_tokens, -1)
            elif what == taps.MOE_NORMS:
                r.moe_norms[layer] = a
            elif what == taps.IMATRIX:
                r.imatrix[layer] = a
        for layer, experts in r.moe_experts.items():  # report in ascending expert id, as the fixture
            order = np.argsort(experts, axis=1, kind="stable")
            r.moe_experts[layer] = np.take_along_axis(experts, order, 1)
            r.moe_weights[layer] = np.take_along_axis(r.moe_weights[layer], order, 1)
            if layer in r.moe_norms:
                r.moe_norms[layer] = np.take_along_axis(r.moe_norms[layer], order, 1)
        return r

    def close(self) -> None:
        """Free the graph allocator, the caches and the weights' ggml objects. With a lost RPC
        server, what lives on the servers is left as it is: ggml would abort on freeing it."""
        if self.devices is None or self.devices.alive():
            self.cache.free()
            self._exec.free()
            if self.devices is not None:
                self.devices.close()
        self.weights.close()
