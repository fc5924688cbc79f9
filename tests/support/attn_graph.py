"""One MLA (+ DSA) layer run alone: the model's GraphBuild and SequenceCache with F32 weights
made from numpy arrays instead of a GGUF, so the MLA and DSA builders can be checked against
numpy references of the same math without the loader or the other blocks.
"""
from __future__ import annotations

import numpy as np
import ggml

from gguf_arch.arch.tensors import LAYER
from ggml_graph_spec.graph.cache import SequenceCache
from ggml_graph_spec.backends.cpu import Executor
from ggml_graph_spec.graph.build import F32, GraphBuild, new_tensor

N_NODES = 4096  # one attention layer needs a few hundred


class _Weights:
    """`w(name)`, `w.has(name)`, `w.layer`, `w.cfg`, as the loader's LayerWeights; the tensors are
    keyed by what follows "blk.{l}." in the table's names (the layer is implied)."""

    def __init__(self, cfg, layer: int, tensors: dict):
        self.cfg, self.layer, self._t = cfg, layer, tensors

    def __call__(self, name: str):
        return self._t[_suffix(name)]

    def has(self, name: str) -> bool:
        return _suffix(name) in self._t


def _suffix(name: str) -> str:
    return name.removeprefix(LAYER)


class AttnGraph:
    """One MLA layer with the model's caches; `eval` runs a builder on the next tokens."""

    def __init__(self, cfg, layer: int, weights: dict[str, np.ndarray], n_ctx: int, exact: bool = True):
        self.cfg, self.layer, self.exact = cfg, layer, exact
        self.executor = Executor(n_threads=1)
        self._ctx = ggml.ggml_init(ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * (len(weights) + 1), mem_buffer=None, no_alloc=True))
        tensors = {k: new_tensor(self._ctx, F32, tuple(reversed(v.shape))) for k, v in weights.items()}
        self._buf = ggml.ggml_backend_alloc_ctx_tensors(self._ctx, self.executor.backend) if weights else None
        for k, v in weights.items():
            a = np.ascontiguousarray(v, dtype=np.float32)
            ggml.ggml_backend_tensor_set(tensors[k], a.ctypes.data, 0, a.nbytes)
        self.w = _Weights(cfg, layer, tensors)
        self.cache = SequenceCache(cfg, self.executor.backend, n_ctx=n_ctx, exact=exact, with_indexer=True)

    @property
    def n_past(self) -> int:
        return self.cache.n_past

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.cache.n_past = value

    def eval(self, build, x: np.ndarray, top_k: int | None = None, want: tuple[str, ...] = ()) -> tuple:
        """Run `build(g, w, x)` on x [T, n_embd]; returns (output [T, ...], {what: [T, ...]})."""
        T = x.shape[0]

        def make(ctx, gf):
            return GraphBuild(ctx, gf, self.cfg, self.cache, n_tokens=T, exact=self.exact, top_k=top_k, wants=want)

        with self.executor.graph(N_NODES, make) as g:
            out = build(g, self.w, g.input("x", F32, (self.cfg.hidden_size, T), x))
            self.executor.compute(g, [out])
            result = Executor.read(out), {what: Executor.read(t) for (what, _), t in g.records.items()}
        self.cache.n_past += T
        return result
