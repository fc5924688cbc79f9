"""One MLA (+ DSA) layer run alone: the model's GraphBuild and SequenceCache with F32 weights
made from numpy arrays instead of a GGUF, so the MLA and DSA builders can be checked against
numpy references of the same math without the loader or the other blocks.
"""
from __future__ import annotations

import numpy as np
import ggml

from ggml_graph_spec.cache import SequenceCache
from ggml_graph_spec.graph import F32, GraphBuild, new_tensor

_NP = {ggml.GGML_TYPE_F32: np.float32, ggml.GGML_TYPE_I32: np.int32}


def _context(n_tensors: int):
    params = ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * n_tensors
                                   + ggml.ggml_graph_overhead_custom(n_tensors, False),
                                   mem_buffer=None, no_alloc=True)
    return ggml.ggml_init(params)


def _get(t) -> np.ndarray:
    """As a 2-D array [rows, ne0]: every output here is [ne0, n_tokens] (T = 1 included)."""
    assert ggml.ggml_is_contiguous(t)
    out = np.empty((ggml.ggml_nrows(t), t.contents.ne[0]), dtype=_NP[t.contents.type])
    ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
    return out


class _Weights:
    """`w(suffix)`, `w.has(suffix)`, `w.layer`, `w.cfg`, as the loader's LayerWeights."""

    def __init__(self, cfg, layer: int, tensors: dict):
        self.cfg, self.layer, self._t = cfg, layer, tensors

    def __call__(self, suffix: str):
        return self._t[suffix]

    def has(self, suffix: str) -> bool:
        return suffix in self._t


class AttnGraph:
    """One MLA layer with the model's caches; `eval` runs a builder on the next tokens."""

    def __init__(self, cfg, layer: int, weights: dict[str, np.ndarray], n_ctx: int, exact: bool = True):
        self.cfg, self.layer, self.exact = cfg, layer, exact
        self.backend = ggml.ggml_backend_cpu_init()
        self._ctx = _context(len(weights) + 1)
        tensors = {k: new_tensor(self._ctx, F32, tuple(reversed(v.shape))) for k, v in weights.items()}
        self._buf = ggml.ggml_backend_alloc_ctx_tensors(self._ctx, self.backend) if weights else None
        for k, v in weights.items():
            a = np.ascontiguousarray(v, dtype=np.float32)
            ggml.ggml_backend_tensor_set(tensors[k], a.ctypes.data, 0, a.nbytes)
        self.w = _Weights(cfg, layer, tensors)
        self.cache = SequenceCache(cfg, self.backend, n_ctx=n_ctx, exact=exact, with_indexer=True)

    @property
    def n_past(self) -> int:
        return self.cache.n_past

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.cache.n_past = value

    def eval(self, build, x: np.ndarray, top_k: int | None = None, want: tuple[str, ...] = ()) -> tuple:
        """Run `build(g, w, x)` on x [T, n_embd]; returns (output [T, ...], {what: [T, ...]})."""
        T = x.shape[0]
        ctx = _context(4096)
        gf = ggml.ggml_new_graph_custom(ctx, 4096, False)
        g = GraphBuild(ctx, gf, self.cfg, self.cache, n_tokens=T, exact=self.exact, top_k=top_k, wants=want)
        out = build(g, self.w, g.input("x", F32, (self.cfg.hidden_size, T), x))
        ggml.ggml_set_output(out)
        ggml.ggml_build_forward_expand(gf, out)
        galloc = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self.backend))
        try:
            assert ggml.ggml_gallocr_alloc_graph(galloc, gf)
            for t, value in g.inputs:
                if t.contents.buffer:  # inputs the built graph does not read get no memory
                    ggml.ggml_backend_tensor_set(t, value.ctypes.data, 0, value.nbytes)
            assert ggml.ggml_backend_graph_compute(self.backend, gf) == ggml.GGML_STATUS_SUCCESS
            result = _get(out), {what: _get(t) for (what, _), t in g.records.items()}
        finally:
            ggml.ggml_gallocr_free(galloc)
            ggml.ggml_free(ctx)
        self.cache.n_past += T
        return result
