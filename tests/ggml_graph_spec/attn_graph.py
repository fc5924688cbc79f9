"""A minimal stand-in for the model's GraphBuild, enough to run one MLA (+ DSA) layer alone.

It implements the builder-facing half of the conventions in the graph interface (ctx, cfg,
n_tokens/n_past/n_kv, exact, kq_mask, cache, store, mm, rms_norm, dsa_top_k, wants/record) with
F32 weights held in numpy, so the MLA and DSA builders can be checked against numpy references
of the same math without the loader, the other blocks or a GGUF.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import ggml

_NP = {ggml.GGML_TYPE_F32: np.float32, ggml.GGML_TYPE_F16: np.float16, ggml.GGML_TYPE_I32: np.int32}


def _ne(shape) -> ctypes.Array:
    return (ctypes.c_int64 * len(shape))(*reversed(shape))


def _new(ctx, ggml_type: int, shape):
    """A tensor whose ggml ne is numpy `shape` reversed."""
    return ggml.ggml_new_tensor(ctx, ggml_type, len(shape), _ne(shape))


def _set(t, value: np.ndarray) -> None:
    a = np.ascontiguousarray(value, dtype=_NP[t.contents.type])
    assert a.nbytes == ggml.ggml_nbytes(t)
    ggml.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)


def _get(t) -> np.ndarray:
    """As a 2-D array [rows, ne0]: every output here is [ne0, n_tokens] (T = 1 included)."""
    assert ggml.ggml_is_contiguous(t)
    out = np.empty((ggml.ggml_nrows(t), t.contents.ne[0]), dtype=_NP[t.contents.type])
    ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
    return out


def _context(n_tensors: int):
    params = ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * n_tensors + ggml.ggml_graph_overhead(),
                                   mem_buffer=None, no_alloc=True)
    return ggml.ggml_init(params)


class _Weights:
    """`w(suffix)`, `w.has(suffix)`, `w.layer`, `w.cfg` over tensors made from numpy arrays."""

    def __init__(self, cfg, layer: int, tensors: dict):
        self.cfg, self.layer, self._t = cfg, layer, tensors

    def __call__(self, suffix: str):
        return self._t[suffix]

    def has(self, suffix: str) -> bool:
        return suffix in self._t


class _Cache:
    def __init__(self, tensors: dict):
        self._t = tensors

    def mla_latent(self, layer: int):
        return self._t[("mla", layer)]

    def indexer_keys(self, layer: int):
        return self._t[("idx", layer)]


@dataclass
class _Build:
    ctx: object
    gf: object
    cfg: object
    n_tokens: int
    n_past: int
    exact: bool
    cache: _Cache
    top_k: int | None
    want: tuple[str, ...]
    kq_mask: object = None
    inputs: list = field(default_factory=list)
    records: dict = field(default_factory=dict)

    @property
    def n_kv(self) -> int:
        return self.n_past + self.n_tokens

    def input(self, name: str, ggml_type: int, ne: tuple, value: np.ndarray):
        t = ggml.ggml_new_tensor(self.ctx, ggml_type, len(ne), (ctypes.c_int64 * len(ne))(*ne))
        ggml.ggml_set_input(t)
        self.inputs.append((t, value))
        return t

    def store(self, cache, src):
        row, nb1 = cache.contents.ne[0], cache.contents.nb[1]
        dst = ggml.ggml_view_2d(self.ctx, cache, row, self.n_tokens, nb1, self.n_past * nb1)
        ggml.ggml_build_forward_expand(self.gf, ggml.ggml_cpy(self.ctx, src, dst))
        return ggml.ggml_view_2d(self.ctx, cache, row, self.n_kv, nb1, 0)

    def mm(self, w, x):
        return ggml.ggml_mul_mat(self.ctx, w, x)

    def rms_norm(self, x, weight, eps: float):
        return ggml.ggml_mul(self.ctx, ggml.ggml_rms_norm(self.ctx, x, eps), weight)

    def dsa_top_k(self, layer: int) -> int | None:
        return self.top_k if self.cfg.is_dsa(layer) else None

    def wants(self, what: str) -> bool:
        return what in self.want

    def record(self, what: str, layer: int, tensor) -> None:
        self.records[what] = tensor


class AttnGraph:
    """One MLA layer with persistent caches; `eval` runs `build` on the next tokens."""

    def __init__(self, cfg, layer: int, weights: dict[str, np.ndarray], n_ctx: int, exact: bool = True):
        self.cfg, self.layer, self.exact, self.n_past = cfg, layer, exact, 0
        self.backend = ggml.ggml_backend_cpu_init()
        self._ctx = _context(len(weights) + 2)
        tensors = {k: _new(self._ctx, ggml.GGML_TYPE_F32, v.shape) for k, v in weights.items()}
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        cache = {("mla", layer): _new(self._ctx, ggml.GGML_TYPE_F32 if exact else ggml.GGML_TYPE_F16, (n_ctx, latent))}
        if cfg.is_dsa(layer):
            cache[("idx", layer)] = _new(self._ctx, ggml.GGML_TYPE_F32, (n_ctx, cfg.indexer.head_dim))
        self._buf = ggml.ggml_backend_alloc_ctx_tensors(self._ctx, self.backend)
        ggml.ggml_backend_buffer_clear(self._buf, 0)
        for k, v in weights.items():
            _set(tensors[k], v)
        self.w = _Weights(cfg, layer, tensors)
        self.cache = _Cache(cache)

    def eval(self, build, x: np.ndarray, top_k: int | None = None, want: tuple[str, ...] = ()) -> tuple:
        """Run `build(g, w, x)` on x [T, n_embd]; returns (output as numpy [T, ...], records)."""
        T = x.shape[0]
        ctx = _context(4096)
        gf = ggml.ggml_new_graph_custom(ctx, 4096, False)
        g = _Build(ctx, gf, self.cfg, T, self.n_past, self.exact, self.cache, top_k, want)
        x_t = g.input("x", ggml.GGML_TYPE_F32, (self.cfg.hidden_size, T), x)
        g.kq_mask = g.input("kq_mask", ggml.GGML_TYPE_F32, (g.n_kv, T), causal_mask(self.n_past, T))
        out = build(g, self.w, x_t)
        outs = [out, *g.records.values()]
        for t in outs:
            ggml.ggml_set_output(t)
            ggml.ggml_build_forward_expand(gf, t)
        galloc = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self.backend))
        try:
            assert ggml.ggml_gallocr_alloc_graph(galloc, gf)
            for t, value in g.inputs:
                if t.contents.buffer:  # inputs the built graph does not read get no memory
                    _set(t, value)
            assert ggml.ggml_backend_graph_compute(self.backend, gf) == ggml.GGML_STATUS_SUCCESS
            result = _get(out), {k: _get(t) for k, t in g.records.items()}
        finally:
            ggml.ggml_gallocr_free(galloc)
            ggml.ggml_free(ctx)
        self.n_past += T
        return result


def causal_mask(n_past: int, n_tokens: int) -> np.ndarray:
    """[n_tokens, n_past + n_tokens] F32: 0 where key s <= the query's position, -inf elsewhere."""
    pos = n_past + np.arange(n_tokens)[:, None]
    return np.where(np.arange(n_past + n_tokens)[None, :] <= pos, 0.0, -np.inf).astype(np.float32)
