"""A loaded Kimi K3 / K3.1-Pro GGUF with the caches of `n_seq` sequences: the runtime as a library.

    model = Model.load("k3.gguf", LoadOptions(n_ctx=8192, n_seq=4))
    out = model.decode({0: prompt_a, 1: prompt_b})    # seq -> logits of its last token [vocab]
    out = model.decode({0: [tok_a], 1: [tok_b]})     # one graph, both sequences
    model.seq_cp(0, 2); data = model.state_get(0)     # fork, save (engine/state.py)
    logits = model.eval(tokens)                       # sequence 0, every token's logits

Each call builds one graph per micro-batch (graph/ubatch.py) holding every sequence's new tokens:
the weights are read once per step for all of them, each sequence attends over its own cache
rows and runs its own KDA recurrence. The graph is placed and computed by the backend the
options ask for (backends/registry.py); the weights stay in the memory-mapped file.
"""
from __future__ import annotations

from dataclasses import replace
from functools import cached_property, partial
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from gguf_arch.arch.keys import config_from_metadata

from ..backends.registry import Backend, BackendRequest, open_backend
from ..backends.streaming.executor import StreamingExecutor
from ..blocks.forward import build_forward, graph_size
from ..graph import taps
from ..graph.build import I32, GraphBuild
from ..blocks.mla import attention_nodes
from ..graph.cache import SequenceCache, cache_sizes
from ..graph.ubatch import UBatch
from ..text.tokenizer import BPETokenizer
from ..weights.identity import model_identity
from ..weights.loader import GGUFWeights, load_gguf
from ..weights.overrides import apply_overrides, tokenizer_settings
from ..weights.repack import resolve_repack
from . import memory
from .inputs import EvalError, check_input, embedded, recorded, take
from .options import LoadOptions
from .results import WANTS, EvalResult, collect, join_results
from .sequences import Sequences

# Graph nodes a run adds beyond a single-sequence graph, per layer (its attention, masks, views).
_NODES_PER_RUN_LAYER = 96


class Model(Sequences):
    """A loaded GGUF plus the caches of its sequences. Not thread-safe: one caller at a time."""

    def __init__(self, weights: GGUFWeights, options: LoadOptions):
        """options: resolved (LoadOptions.resolve) against weights.cfg."""
        if options.exact_experts and weights.repacked:
            raise EvalError(f"{weights.path}: the exact path dequantizes the experts from the file's layout; "
                            "load the GGUF without repack for it")
        self.weights, self.cfg, self.options = weights, weights.cfg, options
        self._top_k = options.top_k
        self._graph_size = graph_size(weights)
        self._backend = open_backend(weights, BackendRequest(
            options.n_threads, self._graph_size, options.exact_experts, options.rpc, options.tensor_split,
            options.mem_budget, options.progress, options.reply_timeout))
        try:
            self._open_caches(options)
        except BaseException:
            self._backend.close()
            raise
        if isinstance(self.executor, StreamingExecutor):
            self.executor.attach(self.cache.nbytes(self.executor.backend))
        self._tokens: list[list[int]] = [[] for _ in range(options.n_seq)]

    def _open_caches(self, options: LoadOptions) -> None:
        """The caches, once the context is known to fit this host's memory, and the compute buffer
        of the worst micro-batch reserved (engine/memory.py; the CPU backend's, whose memory is
        this host's)."""
        checked = self._backend.name == "cpu"
        with_indexer = bool(options.dsa) and self.cfg.indexer is not None
        sizes = cache_sizes(self.cfg, n_ctx=options.n_ctx_seq, n_seq=options.n_seq, latent_type=options.latent_type(),
                            indexer_type=options.indexer_type(), with_indexer=with_indexer)
        free = memory.free_bytes() if checked else None
        memory.check_fits(options, sizes, None, free)
        devices = self._backend.devices
        self.cache = SequenceCache(
            self.cfg, self.executor.backend, n_ctx=options.n_ctx_seq, n_seq=options.n_seq, exact=options.exact_experts,
            with_indexer=with_indexer, layer_backends=devices and devices.layer_backends(self.executor.backend),
            latent_type=options.latent_type(), indexer_type=options.indexer_type(), clear=False)
        try:
            if checked:
                needs = {self._compute_bytes(u): u for u in memory.worst_ubatches(options)}
                memory.check_fits(options, sizes, max(needs), free)
                self._compute_bytes(needs[max(needs)], reserve=True)
            self.cache.reset()
        except BaseException:
            self.cache.free()
            raise

    def _compute_bytes(self, ubatch: UBatch, reserve: bool = False) -> int:
        """The compute buffer the graph of `ubatch` needs, every logit kept; reserve: allocate it now."""
        with self._graph(ubatch) as g:
            tokens = g.input("tokens", I32, (ubatch.n_tokens,), np.zeros(ubatch.n_tokens, np.int32))
            out = build_forward(g, self.weights, tokens)
            if reserve:
                self.executor.plan(g, [out])
                return 0
            return self.executor.measure(g, [out])

    @classmethod
    def load(cls, path: Path | str, options: LoadOptions | None = None, **fields) -> "Model":
        """Open, validate and load a kimi-k3 GGUF. `fields` set LoadOptions fields (engine/options.py
        says what each means): Model.load(p, n_ctx=4096, exact_experts=True) is
        Model.load(p, LoadOptions(n_ctx=4096, exact_experts=True)). Every option is checked before
        any ggml object exists."""
        options = replace(options or LoadOptions(), **fields).check()
        resolved: list[LoadOptions] = []

        def adjust(meta, cfg):  # after the file's own checks, before the first ggml object
            meta, cfg = apply_overrides(meta, cfg, options.overrides, str(path), config_from_metadata)
            resolved.append(options.resolve(cfg, str(path)))
            return meta, cfg
        repack = resolve_repack(options.repack, exact=options.exact_experts, rpc=bool(options.rpc),
                                mem_budget=options.mem_budget is not None)
        weights = load_gguf(path, repack=repack, adjust=adjust)
        try:
            return cls(weights, resolved[0])
        except BaseException:
            weights.close()
            raise

    # ---- settings ----------------------------------------------------------------------------
    @property
    def exact(self) -> bool:
        return self.options.exact_experts

    @property
    def dsa(self) -> bool:
        return self.options.dsa

    @property
    def dsa_path(self) -> str:
        return self.options.dsa_path

    @property
    def n_batch(self) -> int:
        """The most prompt tokens a generation step feeds (-b)."""
        return self.options.n_batch

    @property
    def n_ubatch(self) -> int:
        """The most positions one graph computes (-ub, at most -b)."""
        return self.options.n_ubatch_eff

    @property
    def top_k(self) -> int | None:
        """The indexer top-k in use (None: DSA off or a plain K3 GGUF)."""
        if not self.dsa or self.cfg.indexer is None:
            return None
        return self._top_k if self._top_k is not None else self.cfg.indexer.top_k

    @top_k.setter
    def top_k(self, value: int | None) -> None:
        if value is not None:
            replace(self.options, top_k=value).check().resolve(self.cfg, str(self.weights.path))
        self._top_k = value

    @property
    def n_seq(self) -> int:
        return self.cache.n_seq

    @property
    def n_ctx(self) -> int:
        """Tokens each sequence may hold."""
        return self.cache.n_ctx

    @property
    def n_past(self) -> int:
        """Tokens sequence 0 holds."""
        return self.cache.pos[0]

    @property
    def executor(self):
        """What runs the graphs: the CPU executor, the RPC devices' scheduler, or the memory
        budget's streaming executor (backends/registry.py)."""
        return self._backend.executor

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def devices(self):
        return self._backend.devices

    @cached_property
    def tokenizer(self) -> BPETokenizer:
        """The GGUF's tokenizer, with the options' tokenizer overrides (BOS / EOS ids, add BOS)."""
        tok = BPETokenizer.from_gguf(self.weights.reader)
        for attr, value in tokenizer_settings(self.options.overrides).items():
            setattr(tok, attr, value)
        return tok

    @cached_property
    def identity(self) -> str:
        """A digest of the model as loaded (weights/identity.py): what a saved state must match."""
        return model_identity(self.weights)

    # ---- running -----------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every sequence."""
        self._check_devices("before a reset")
        self.cache.reset()
        self._tokens = [[] for _ in range(self.n_seq)]

    def decode(self, batch: Mapping[int, Sequence[int] | np.ndarray] | Sequence[tuple[int, Sequence[int] | np.ndarray]],
               logits: str = "last") -> dict[int, np.ndarray]:
        """Append each sequence's new input and compute, in one graph per micro-batch of at most
        n_ubatch positions. An input is token ids, or embedding rows float32 [n, n_embd] in place
        of token embeddings (engine/inputs.py). logits "last": seq -> [vocab] of its last position;
        "all": seq -> [n, vocab]. Everything is checked first: on an error no sequence has changed."""
        items = list(batch.items()) if isinstance(batch, Mapping) else list(batch)
        todo = self._check_batch(items)
        out: dict[int, list[np.ndarray]] = {seq: [] for seq, _ in todo}
        step = self.n_ubatch
        while todo:
            chunk, todo = take(todo, step)
            for seq, rows in self._run_ubatch(chunk, logits == "all").items():
                out[seq].append(rows)
        return {seq: (np.concatenate(parts) if logits == "all" else parts[-1][-1]) for seq, parts in out.items()}

    def eval(self, tokens: Sequence[int], seq: int = 0) -> np.ndarray:
        """Logits [n_tokens, vocab] for `tokens`, which are appended to sequence seq."""
        return self.run(tokens, seq=seq).logits

    def run(self, tokens: Sequence[int], want: Iterable[str] = (), seq: int = 0) -> EvalResult:
        """Like eval, with extra outputs: any of WANTS ("moe_norms" and "imatrix": graph/taps.py).
        The tokens go through the graph n_ubatch at a time (the caches make that the same
        computation); the results are joined as if computed in one call."""
        want = frozenset(want)
        if taps.MOE_NORMS in want:  # reported in the order of moe_experts, which sorts them
            want |= {"moe"}
        unknown = sorted(want - WANTS)
        if unknown:
            raise EvalError(f"unknown output(s) {unknown}; available: {sorted(WANTS)}")
        ((seq, ids),) = self._check_batch([(seq, tokens)])
        step = self.n_ubatch
        parts = [self._run_single(seq, ids[i:i + step], want) for i in range(0, len(ids), step)]
        return parts[0] if len(parts) == 1 else join_results(parts)

    def _check_batch(self, items: list) -> list[tuple[int, np.ndarray]]:
        if not items:
            raise EvalError("no tokens to evaluate")
        seqs = [self._seq(s) for s, _ in items]
        if len(set(seqs)) != len(seqs):
            raise EvalError(f"a sequence appears twice in one batch: {seqs}")
        out = []
        for seq, value in zip(seqs, (v for _, v in items)):
            x = check_input(seq, value, self.cfg)
            if self.cache.pos[seq] + len(x) > self.n_ctx:
                raise EvalError(f"context full: {self.cache.pos[seq]} cached + {len(x)} new tokens > n_ctx "
                                f"{self.n_ctx}" + (f" (sequence {seq})" if self.n_seq > 1 else ""))
            out.append((seq, x))
        return out

    def _graph(self, ubatch: UBatch, want: frozenset = frozenset()):
        make = partial(GraphBuild, cfg=self.cfg, cache=self.cache, ubatch=ubatch, exact=self.exact,
                       top_k=self.top_k, wants=want, dsa_path=self.dsa_path, segments=self.executor.segments,
                       bind_experts=self.executor.bind_experts, predict_experts=self.executor.predict_experts)
        size = self._graph_size + (taps.NODES_PER_LAYER * self.cfg.num_layers if want & taps.WANTS else 0)
        size += (len(ubatch.runs) - 1) * _NODES_PER_RUN_LAYER * self.cfg.num_layers
        size += len(self.cfg.mla_layers) * sum(attention_nodes(self.cfg, self.exact, r, self.top_k) for r in ubatch.runs)
        return self.executor.graph(size, make)

    def _compute(self, ubatch: UBatch, values: dict[int, np.ndarray], out_ids: np.ndarray | None,
                 want: frozenset):
        """The micro-batch's forward builder, its memory planned first where the executor wants it."""
        def forward(g):
            ids = None if out_ids is None else g.input("out_ids", I32, (len(out_ids),), out_ids)
            return build_forward(g, self.weights, out_ids=ids, embedded=embedded(g, self.weights, ubatch, values))
        if want or self.executor.wants_plan:  # a fresh memory plan (Executor.plan and wants_plan say why)
            with self._graph(ubatch, want) as g:
                self.executor.plan(g, [forward(g)])
        return forward

    def _run_single(self, seq: int, x: np.ndarray, want: frozenset) -> EvalResult:
        ubatch = UBatch([(seq, self.cache.pos[seq], len(x))])
        forward = self._compute(ubatch, {seq: x}, None, want)
        with self._graph(ubatch, want) as g:
            logits = forward(g)
            self.executor.compute(g, [logits])
            result = collect(g, self._finite(self.executor.read(logits)), self.executor.read)
        self._advance(ubatch, {seq: x})
        return result

    def _run_ubatch(self, chunk: list[tuple[int, np.ndarray]], all_logits: bool) -> dict[int, np.ndarray]:
        ubatch = UBatch([(seq, self.cache.pos[seq], len(x)) for seq, x in chunk])
        out_ids = None if all_logits else np.asarray(ubatch.last_columns(), np.int32)
        forward = self._compute(ubatch, dict(chunk), out_ids, frozenset())
        with self._graph(ubatch) as g:
            logits = forward(g)
            self.executor.compute(g, [logits])
            rows = self._finite(self.executor.read(logits))
        self._advance(ubatch, dict(chunk))
        if not all_logits:
            return {r.seq: rows[i:i + 1] for i, r in enumerate(ubatch.runs)}
        return {r.seq: rows[r.offset:r.offset + r.n_tokens] for r in ubatch.runs}

    def _advance(self, ubatch: UBatch, values: dict[int, np.ndarray]) -> None:
        for r in ubatch.runs:
            self.cache.pos[r.seq] += r.n_tokens
            self._tokens[r.seq].extend(recorded(values[r.seq]))

    def _finite(self, logits: np.ndarray) -> np.ndarray:
        """A NaN or infinite logit is an error, never a sampled token or a perplexity of nan: finite
        weights and metadata values can still overflow f32 inside the graph (an expert weight scale
        of 1e38 given by --override-kv)."""
        bad = np.argwhere(~np.isfinite(logits))
        if bad.size:
            i, j = (int(x) for x in bad[0])
            raise EvalError(f"{self.weights.path}: the model computed a non-finite logit ({logits[i, j]}) for token "
                            f"{i} of the batch, vocabulary id {j}: a weight or metadata value (--override-kv?) "
                            "overflows float32 in the graph")
        return logits

    def close(self) -> None:
        """Free the graph allocator, the caches and the weights' ggml objects. With a lost RPC
        server, what lives on the servers is left as it is: ggml would abort on freeing it."""
        if self.devices is None or self.devices.alive():
            self.cache.free()
            self._backend.close()
        self.weights.close()

