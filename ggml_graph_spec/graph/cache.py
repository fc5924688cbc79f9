"""Persistent per-sequence state, allocated once per model in one buffer per device.

Per KDA layer (docs/reference/dsa.md#caches): three short-conv states (the last kernel-1 projected inputs
of q, k and v) and the delta-rule state, all F32. Per MLA layer: the latent cache (normed latent
then k_pe per token; F32 on the exact path, F16 on the fast path). Per DSA layer: the indexer
key cache (F32). The per-token caches are sized from n_ctx; graphs write them in place
(`GraphBuild.store` / `overwrite`), so nothing is copied between calls. A model split over
devices keeps each layer's state on that layer's device (`layer_backends`).
"""
from __future__ import annotations

from typing import Any, Mapping

import ggml

from gguf_arch.arch.config import K3Config

from .build import F16, F32, new_tensor

CONV_INPUTS = ("q", "k", "v")


class SequenceCache:
    def __init__(self, cfg: K3Config, backend, *, n_ctx: int, exact: bool, with_indexer: bool,
                 layer_backends: Mapping[int, Any] | None = None):
        self.cfg = cfg
        self.n_ctx = n_ctx
        self.n_past = 0
        kda = cfg.kda
        backend_of = {l: (layer_backends or {}).get(l, backend) for l in range(cfg.num_layers)}
        # One no-alloc context per device, its tensors allocated in one buffer there.
        self._ctxs = {b: self._context(cfg) for b in backend_of.values()}
        self._ctx_of = {l: self._ctxs[b] for l, b in backend_of.items()}
        self._conv: dict[tuple[int, str], object] = {}
        self._state: dict[int, object] = {}
        self._latent: dict[int, object] = {}
        self._index: dict[int, object] = {}
        for l in kda.layers:
            for x in CONV_INPUTS:
                self._conv[(l, x)] = self._new(l, f"kda_conv_{x}.{l}", F32, (kda.conv_kernel - 1, kda.proj_dim))
            # ggml_gated_delta_net's layout: per head a [S_v, S_k] block (numpy [h][v][k]).
            self._state[l] = self._new(l, f"kda_state.{l}", F32, (kda.head_dim, kda.head_dim, kda.num_heads))
        for l in cfg.mla_layers:
            self._latent[l] = self._new(l, f"mla_latent.{l}", F32 if exact else F16,
                                        (cfg.kv_lora_rank + cfg.qk_rope_head_dim, n_ctx))
            if with_indexer and cfg.is_dsa(l):
                self._index[l] = self._new(l, f"indexer_keys.{l}", F32, (cfg.indexer.head_dim, n_ctx))
        # backend None: shapes only, nothing allocated (graphs can be built and analysed, not run).
        self._buffers = {b: ggml.ggml_backend_alloc_ctx_tensors(ctx, b) for b, ctx in self._ctxs.items()
                         if b is not None}
        self.reset()

    @staticmethod
    def _context(cfg: K3Config):
        n_tensors = 4 * len(cfg.kda.layers) + 2 * len(cfg.mla_layers)
        return ggml.ggml_init(ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * max(1, n_tensors), mem_buffer=None, no_alloc=True))

    def _new(self, layer: int, name: str, ggml_type: int, ne: tuple[int, ...]):
        t = new_tensor(self._ctx_of[layer], ggml_type, ne)
        ggml.ggml_set_name(t, name.encode())
        return t

    def nbytes(self, backend) -> int:
        """Bytes of state held on `backend`."""
        buf = self._buffers.get(backend)
        return ggml.ggml_backend_buffer_get_size(buf) if buf else 0

    def reset(self) -> None:
        """Forget the sequence: zero every state and cache."""
        for buf in self._buffers.values():
            if buf:
                ggml.ggml_backend_buffer_clear(buf, 0)
        self.n_past = 0

    def kda_conv(self, layer: int, which: str):
        """ne [kernel-1, proj_dim]: the last kernel-1 inputs of the q/k/v short conv, oldest first."""
        return self._conv[(layer, which)]

    def kda_state(self, layer: int):
        """ne [head_dim, head_dim, n_heads]: the delta-rule state in ggml_gated_delta_net's layout."""
        return self._state[layer]

    def mla_latent(self, layer: int):
        """ne [kv_lora_rank + qk_rope_head_dim, n_ctx]: normed latent then raw k_pe, per token."""
        return self._latent[layer]

    def indexer_keys(self, layer: int):
        """ne [index_head_dim, n_ctx]: the LayerNorm-ed indexer key per token (DSA layers)."""
        return self._index[layer]

    def has_indexer(self, layer: int) -> bool:
        return layer in self._index

    def free(self) -> None:
        for buf in self._buffers.values():
            if buf:
                ggml.ggml_backend_buffer_free(buf)
        self._buffers = {}
        for ctx in self._ctxs.values():
            ggml.ggml_free(ctx)
        self._ctxs = {}
