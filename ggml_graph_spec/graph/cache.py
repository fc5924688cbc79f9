"""Persistent per-sequence state of `n_seq` sequences, allocated once per model in one buffer per
device.

Per KDA layer (docs/reference/dsa.md#caches): three short-conv states (the last kernel-1
projected inputs of q, k and v) and the delta-rule state, F32, one plane per sequence (the last
dimension). Per MLA layer: the latent cache (normed latent then k_pe per token; F32 on the exact
path, F16 on the fast path by default), `n_ctx` rows per sequence. Per DSA layer: the indexer key
cache (F32 by default), `n_ctx` rows per sequence. Graphs write them in place (`GraphBuild.store`
/ `overwrite`), so nothing is copied between calls. A model split over devices keeps each layer's
state on that layer's device (`layer_backends`).

Each sequence's state is the same bytes whatever the other sequences do: a sequence's rows and
planes are its own, and `bytes_per_token` / `bytes_per_sequence` are exact (the formula the runner's
summary prints and a test checks against ggml's own sizes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import ggml

from gguf_arch.arch.config import K3Config

from .build import F16, F32, new_tensor

CONV_INPUTS = ("q", "k", "v")


@dataclass(frozen=True)
class CacheSizes:
    """Bytes of each cache of a context, in all (every layer, every sequence)."""

    latent: int  # the MLA latent rows: n_seq x n_ctx x (kv_lora + rope) values of its type, per MLA layer
    indexer: int  # the DSA indexer keys: n_seq x n_ctx x index_head_dim values of its type, per DSA layer
    kda_conv: int  # the KDA short-conv states: n_seq x 3 x (kernel - 1) x proj_dim F32, per KDA layer
    kda_state: int  # the KDA recurrent states: n_seq x heads x head_dim^2 F32, per KDA layer

    @property
    def total(self) -> int:
        return self.latent + self.indexer + self.kda_conv + self.kda_state


def cache_sizes(cfg: K3Config, *, n_ctx: int, n_seq: int, latent_type: int, indexer_type: int,
                with_indexer: bool) -> CacheSizes:
    """The caches' bytes from the model's sizes alone (what SequenceCache allocates, before it
    does: the load refuses a context that does not fit with these figures)."""
    kda = cfg.kda
    n_dsa = sum(1 for l in cfg.mla_layers if cfg.is_dsa(l)) if with_indexer and cfg.indexer is not None else 0
    latent_row = ggml.ggml_row_size(latent_type, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    index_row = ggml.ggml_row_size(indexer_type, cfg.indexer.head_dim) if n_dsa else 0
    f32 = ggml.ggml_type_size(F32)
    return CacheSizes(
        latent=len(cfg.mla_layers) * n_seq * n_ctx * latent_row,
        indexer=n_dsa * n_seq * n_ctx * index_row,
        kda_conv=len(kda.layers) * n_seq * len(CONV_INPUTS) * (kda.conv_kernel - 1) * kda.proj_dim * f32,
        kda_state=len(kda.layers) * n_seq * kda.num_heads * kda.head_dim * kda.head_dim * f32)


class SequenceCache:
    def __init__(self, cfg: K3Config, backend, *, n_ctx: int, exact: bool, with_indexer: bool,
                 layer_backends: Mapping[int, Any] | None = None, n_seq: int = 1,
                 latent_type: int | None = None, indexer_type: int = F32, clear: bool = True):
        """n_ctx: cache rows per sequence. latent_type: the MLA latent cache's ggml type (None: F32
        on the exact path, F16 on the fast one); indexer_type: the indexer key cache's. clear
        False: the buffers are allocated but not yet written (no page touched: reset() does it)."""
        self.cfg = cfg
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.latent_type = (F32 if exact else F16) if latent_type is None else latent_type
        self.indexer_type = indexer_type
        self.pos = [0] * n_seq  # tokens held per sequence
        backend_of = {l: (layer_backends or {}).get(l, backend) for l in range(cfg.num_layers)}
        # One no-alloc context per device, its tensors allocated in one buffer there.
        self._ctxs = {b: self._context(cfg) for b in backend_of.values()}
        self._ctx_of = {l: self._ctxs[b] for l, b in backend_of.items()}
        self._conv: dict[tuple[int, str], object] = {}
        self._state: dict[int, object] = {}
        self._latent: dict[int, object] = {}
        self._index: dict[int, object] = {}
        self._make_tensors(cfg, with_indexer)
        self.with_indexer = bool(self._index)
        # backend None: shapes only, nothing allocated (graphs can be built and analysed, not run).
        self._buffers = {b: ggml.ggml_backend_alloc_ctx_tensors(ctx, b) for b, ctx in self._ctxs.items()
                         if b is not None}
        if any(not buf for buf in self._buffers.values()):
            self.free()
            raise MemoryError(f"cannot allocate the caches of {n_seq} sequence(s) x {n_ctx} tokens")
        if clear:
            self.reset()

    def _make_tensors(self, cfg: K3Config, with_indexer: bool) -> None:
        kda, S = cfg.kda, self.n_seq
        for l in kda.layers:
            for x in CONV_INPUTS:
                self._conv[(l, x)] = self._new(l, f"kda_conv_{x}.{l}", F32, (kda.conv_kernel - 1, kda.proj_dim, S))
            # ggml_gated_delta_net's layout: per head a [S_v, S_k] block (numpy [h][v][k]).
            self._state[l] = self._new(l, f"kda_state.{l}", F32, (kda.head_dim, kda.head_dim, kda.num_heads, S))
        for l in cfg.mla_layers:
            self._latent[l] = self._new(l, f"mla_latent.{l}", self.latent_type,
                                        (cfg.kv_lora_rank + cfg.qk_rope_head_dim, self.n_ctx, S))
            if with_indexer and cfg.is_dsa(l):
                self._index[l] = self._new(l, f"indexer_keys.{l}", self.indexer_type,
                                           (cfg.indexer.head_dim, self.n_ctx, S))

    @staticmethod
    def _context(cfg: K3Config):
        n_tensors = 4 * len(cfg.kda.layers) + 2 * len(cfg.mla_layers)
        return ggml.ggml_init(ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * max(1, n_tensors), mem_buffer=None, no_alloc=True))

    def _new(self, layer: int, name: str, ggml_type: int, ne: tuple[int, ...]):
        t = new_tensor(self._ctx_of[layer], ggml_type, ne)
        ggml.ggml_set_name(t, name.encode())
        return t

    # ---- sizes -------------------------------------------------------------------------------
    def nbytes(self, backend) -> int:
        """Bytes of state held on `backend`."""
        buf = self._buffers.get(backend)
        return ggml.ggml_backend_buffer_get_size(buf) if buf else 0

    @property
    def latent_type_name(self) -> str:
        return ggml.ggml_type_name(self.latent_type).decode()

    @property
    def indexer_type_name(self) -> str:
        return ggml.ggml_type_name(self.indexer_type).decode()

    def bytes_per_token(self) -> dict[str, int]:
        """Per sequence and token of context: {"latent": .., "indexer": ..} (the per-token caches)."""
        return {"latent": sum(_row_bytes(t) for t in self._latent.values()),
                "indexer": sum(_row_bytes(t) for t in self._index.values())}

    def sizes(self) -> CacheSizes:
        """The bytes of each cache as allocated (ggml's own tensor sizes)."""
        nbytes = lambda ts: sum(ggml.ggml_nbytes(t) for t in ts)  # noqa: E731
        return CacheSizes(nbytes(self._latent.values()), nbytes(self._index.values()), nbytes(self._conv.values()),
                          nbytes(self._state.values()))

    def bytes_per_sequence(self) -> int:
        """Per sequence, whatever its length: the KDA conv and recurrent states."""
        return sum(ggml.ggml_nbytes(t) for t in (*self._conv.values(), *self._state.values())) // self.n_seq

    # ---- sequences ---------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Tokens held by sequence 0 (the single-sequence view of the cache)."""
        return self.pos[0]

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.pos[0] = value

    def reset(self) -> None:
        """Forget every sequence: zero every state and cache."""
        for buf in self._buffers.values():
            if buf:
                ggml.ggml_backend_buffer_clear(buf, 0)
        self.pos = [0] * self.n_seq

    def state_tensors(self) -> Iterator[tuple[str, object]]:
        """(kind, tensor) of every state in a fixed order: per layer, KDA conv q/k/v and recurrent
        state, or the MLA latent cache then the indexer keys. A sequence's part of each is its
        plane (the last dimension); of the per-token caches, its first rows (state.py)."""
        for l in range(self.cfg.num_layers):
            if self.cfg.is_kda(l):
                for x in CONV_INPUTS:
                    yield "conv", self._conv[(l, x)]
                yield "state", self._state[l]
            else:
                yield "latent", self._latent[l]
                if l in self._index:
                    yield "indexer", self._index[l]

    # ---- tensors the blocks read -------------------------------------------------------------
    def kda_conv(self, layer: int, which: str):
        """ne [kernel-1, proj_dim, n_seq]: the last kernel-1 inputs of the q/k/v short conv, oldest first."""
        return self._conv[(layer, which)]

    def kda_state(self, layer: int):
        """ne [head_dim, head_dim, n_heads, n_seq]: the delta-rule state in ggml_gated_delta_net's layout."""
        return self._state[layer]

    def mla_latent(self, layer: int):
        """ne [kv_lora_rank + qk_rope_head_dim, n_ctx, n_seq]: normed latent then raw k_pe, per token."""
        return self._latent[layer]

    def indexer_keys(self, layer: int):
        """ne [index_head_dim, n_ctx, n_seq]: the LayerNorm-ed indexer key per token (DSA layers)."""
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


def _row_bytes(t) -> int:
    return t.contents.nb[1]
