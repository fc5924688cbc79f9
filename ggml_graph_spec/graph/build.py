"""The per-call graph context every block builder receives.

A `GraphBuild` bundles the ggml context and graph being built with what one `eval` call knows:
how many tokens, how many are already cached, the causal mask, the exact/fast switch, the DSA
settings, which extra outputs were asked for. Builders add nodes through it; the model then
allocates the graph once (ggml-alloc), uploads `inputs`, computes and reads `records`.
"""
from __future__ import annotations

import ctypes
from functools import partial
from typing import Any, Callable, Hashable, Iterable, Iterator

import ggml
import numpy as np

from gguf_arch.arch.config import K3Config

from . import taps

# What every builder passes around: a node of the graph (or a weight) as ggml-python's pointer.
Tensor = ggml.ggml_tensor_p

from .placement import INPUT_SEGMENT
from .ubatch import SeqRun, Span, UBatch

F32 = ggml.GGML_TYPE_F32
F16 = ggml.GGML_TYPE_F16
I32 = ggml.GGML_TYPE_I32

# How a DSA layer attends to its selected keys: "masked" runs attention over the whole cache with
# the selection as a mask; "gather" copies only the selected cache rows and attends over those.
DSA_PATHS = ("masked", "gather")

# The exact path dequantizes weights in chunks of at most this many F32 bytes (see GraphBuild.mm).
DEQUANT_CHUNK_BYTES = 256 << 20

# Moonshot's reference normalises KDA's q/k (L2 norm, fla's eps) and MLA's q_a/kv_a latents
# (layernorms built without eps, so the class default) with eps 1e-6; llama.cpp uses the model's
# rms_norm_eps (1e-5) for both. See GraphBuild.qk_latent_eps.
REFERENCE_QK_LATENT_EPS = 1e-6

NUMPY_OF = {F32: np.float32, F16: np.float16, I32: np.int32}


def new_tensor(ctx, ggml_type: int, ne: tuple[int, ...]):
    return ggml.ggml_new_tensor(ctx, ggml_type, len(ne), (ctypes.c_int64 * len(ne))(*ne))


def _input_array(name: str, ggml_type: int, ne: tuple[int, ...], value: np.ndarray) -> np.ndarray:
    value = np.ascontiguousarray(value, dtype=NUMPY_OF[ggml_type])
    if value.shape != tuple(reversed(ne)):
        raise ValueError(f"input {name}: value shape {value.shape} does not match ne {ne}")
    return value


def causal_mask(n_past: int, n_tokens: int) -> np.ndarray:
    """[n_tokens, n_kv] with 0 where key s <= the query's position n_past + t, -inf elsewhere."""
    mask = np.zeros((n_tokens, n_past + n_tokens), np.float32)
    mask[:, n_past:] = np.triu(np.full((n_tokens, n_tokens), -np.inf, np.float32), 1)
    return mask


class GraphBuild:
    """One graph under construction.

    Builders read ctx/gf/cfg/cache, `ubatch` (the runs of sequences the graph computes, ubatch.py),
    n_tokens (all of them), exact, dsa_path (one of DSA_PATHS) and `kq_mask(run)` (F32
    [n_kv, n_tokens] of the run, 0 / -inf causal); they add inputs with `input` (`constant` for
    one shared by several builders), write the persistent caches with `store` / `overwrite` /
    `plane` / `gather_planes` / `scatter_planes`, and keep extra outputs with `record`. A graph of
    one run (a single sequence) also has `n_past`, `n_kv` and `kq_mask` as plain attributes.

    With `segments`, every tensor is also labelled with the segment (a layer index, or
    placement.INPUT_SEGMENT / OUTPUT_SEGMENT) that was current when it was created
    (`begin_segment`), so that an executor over several devices can run each segment where its
    weights and caches are.
    """

    def __init__(self, ctx, gf, cfg: K3Config, cache, *, exact: bool, top_k: int | None,
                 n_tokens: int | None = None, ubatch: UBatch | None = None, wants: Iterable[str] = (),
                 dsa_path: str = "masked", segments: bool = False, bind_experts: Callable | None = None,
                 predict_experts: Callable | None = None):
        """Give either `ubatch` or `n_tokens` (one run of sequence 0 after its cached tokens)."""
        self.ctx = ctx
        self.gf = gf
        self.cfg = cfg
        self.cache = cache
        self.ubatch = ubatch if ubatch is not None else UBatch.single(cache.n_past, n_tokens)
        self.n_tokens = self.ubatch.n_tokens
        self.exact = exact
        # (g, layer, ids, expert stacks) -> (ids, stacks) the expert matmuls read: Executor.bind_experts
        self.bind_experts = bind_experts
        # (g, next MoE layer, build its predicted ids) -> None: Executor.predict_experts
        self.predict_experts = predict_experts
        self._top_k = top_k
        if dsa_path not in DSA_PATHS:
            raise ValueError(f"dsa_path must be one of {DSA_PATHS}, got {dsa_path!r}")
        self.dsa_path = dsa_path
        self._wants = frozenset(wants)
        self.inputs: list[tuple[Any, np.ndarray | Callable[[], np.ndarray]]] = []
        self.records: dict[tuple[str, int | str], Any] = {}  # (what, layer or weight name) -> tensor
        self._constants: dict[str, Any] = {}
        self._segments: dict[int, Hashable] | None = {} if segments else None  # tensor address -> segment
        self._segment: Hashable = INPUT_SEGMENT
        self._seen = None  # the last tensor of ctx given a segment
        runs = self.ubatch.runs
        self._masks = {r.seq: self.input("kq_mask" if len(runs) == 1 else f"kq_mask.{r.seq}", F32,
                                         (r.n_kv, r.n_tokens), partial(causal_mask, r.n_past, r.n_tokens))
                       for r in runs}
        if len(runs) == 1:  # the single-sequence view
            self.n_past, self.n_kv = runs[0].n_past, runs[0].n_kv
            self.kq_mask = self._masks[runs[0].seq]

    def kq_mask_of(self, run: SeqRun | Span):
        """The causal mask of one run, F32 [n_kv, n_tokens] (0 / -inf); of a span, its rows (a view)."""
        if isinstance(run, SeqRun):
            return self._masks[run.seq]
        mask = self._masks[run.run.seq]
        if run.n == run.run.n_tokens:
            return mask
        nb1 = mask.contents.nb[1]
        return ggml.ggml_view_2d(self.ctx, mask, run.n_kv, run.n, nb1, run.t0 * nb1)

    # ---- inputs and outputs ------------------------------------------------------------------
    def input(self, name: str, ggml_type: int, ne: tuple[int, ...], value: np.ndarray | Callable[[], np.ndarray]):
        """A graph input whose data (numpy, C order = ne reversed) is uploaded before compute; a
        callable value is made only then (a graph built to be measured never makes it)."""
        t = new_tensor(self.ctx, ggml_type, ne)
        ggml.ggml_set_name(t, name.encode())
        ggml.ggml_set_input(t)
        if callable(value):
            self.inputs.append((t, lambda: _input_array(name, ggml_type, ne, value())))
        else:
            self.inputs.append((t, _input_array(name, ggml_type, ne, value)))
        return t

    def input_arrays(self) -> Iterator[tuple[Any, np.ndarray]]:
        """(tensor, data) of every input, the lazy ones made now."""
        for t, value in self.inputs:
            yield t, value() if callable(value) else value

    def constant(self, name: str, ggml_type: int, ne: tuple[int, ...], value: np.ndarray):
        """An input made once per graph however many builders ask for it by `name`."""
        if name not in self._constants:
            self._constants[name] = self.input(name, ggml_type, ne, value)
        return self._constants[name]

    # ---- segments ----------------------------------------------------------------------------
    def begin_segment(self, segment: Hashable) -> None:
        """Tensors created from now on belong to `segment` (until the next call).

        With segments, every op enters the graph in creation order (here, and wherever a
        builder expands the graph: `expand`), so that each segment's nodes are contiguous and
        start with the segment's first op. ggml's scheduler cuts the graph into per-device runs
        of consecutive nodes, starting a run at its first non-view node; ggml's RPC client sends
        a run's nodes to its server, and a view of another device's tensor among them fails
        there. A depth-first expansion from a later node could put such a view first."""
        if self._segments is not None:
            self._label(expand=True)
            self._segment = segment

    def expand(self, t) -> None:
        """Add t (and what it depends on) to the graph now: side effects such as cache writes
        take their place in the node order here."""
        if self._segments is not None:
            self._label(expand=True)  # everything created so far, t included, in creation order
        ggml.ggml_build_forward_expand(self.gf, t)

    def segment_of(self, t) -> Hashable | None:
        """The segment t was created in (None: not made in this graph's context)."""
        if self._segments is None:
            return None
        self._label(expand=False)
        return self._segments.get(ctypes.addressof(t.contents))

    def segments_by_address(self) -> dict[int, Hashable]:
        """segment_of for every tensor at once: tensor address -> segment (empty without segments)."""
        if self._segments is None:
            return {}
        self._label(expand=False)
        return self._segments

    def _label(self, expand: bool) -> None:
        # ggml keeps a context's tensors in creation order: label the ones made since the last call.
        t = ggml.ggml_get_next_tensor(self.ctx, self._seen) if self._seen else ggml.ggml_get_first_tensor(self.ctx)
        while t:
            self._segments[ctypes.addressof(t.contents)] = self._segment
            if expand and t.contents.op != ggml.GGML_OP_NONE:
                ggml.ggml_build_forward_expand(self.gf, t)
            self._seen, t = t, ggml.ggml_get_next_tensor(self.ctx, t)

    def wants(self, what: str) -> bool:
        return what in self._wants

    def record(self, what: str, layer: int | str, t) -> None:
        """Keep `t` as an extra output (kept alive by the allocator, read after compute)."""
        if not ggml.ggml_is_contiguous(t):
            t = ggml.ggml_cont(self.ctx, t)
        ggml.ggml_set_output(t)
        self.expand(t)
        self.records[(what, layer)] = t

    # ---- persistent state --------------------------------------------------------------------
    def store(self, cache_tensor, src, run: SeqRun | None = None):
        """Write src [row, n_tokens of the run] into the run's rows n_past.. of cache_tensor
        [row, n_ctx, n_seq] (its sequence's plane); a view of that plane's rows 0..n_kv.
        run None: the graph's only run."""
        run = run if run is not None else self.ubatch.runs[0]
        c = cache_tensor.contents
        row_bytes, base = c.nb[1], run.seq * c.nb[2]
        dst = ggml.ggml_view_2d(self.ctx, cache_tensor, c.ne[0], run.n_tokens, row_bytes,
                                base + run.n_past * row_bytes)
        self.expand(ggml.ggml_cpy(self.ctx, src, dst))
        return ggml.ggml_view_2d(self.ctx, cache_tensor, c.ne[0], run.n_kv, row_bytes, base)

    def overwrite(self, state_tensor, src) -> None:
        """Replace a whole persistent state (same element count) with src at the end of its use."""
        dst = ggml.ggml_view_1d(self.ctx, state_tensor, ggml.ggml_nelements(state_tensor), 0)
        src = ggml.ggml_cont(self.ctx, src) if not ggml.ggml_is_contiguous(src) else src
        flat = ggml.ggml_reshape_1d(self.ctx, src, ggml.ggml_nelements(src))
        self.expand(ggml.ggml_cpy(self.ctx, flat, dst))

    # ---- per-sequence planes of a state [..., n_seq] -------------------------------------------
    def _plane_elems(self, state_tensor) -> int:
        # The last dimension is the sequence (cache.py); ggml_n_dims would skip it at n_seq 1.
        return ggml.ggml_nelements(state_tensor) // self.cache.n_seq

    def plane(self, state_tensor, seq: int, count: int = 1):
        """The planes of sequences seq .. seq+count-1 of a state, as one flat view (no copy)."""
        n = self._plane_elems(state_tensor)
        return ggml.ggml_view_1d(self.ctx, state_tensor, n * count, seq * n * ggml.ggml_element_size(state_tensor))

    def gather_planes(self, state_tensor, seqs: list[int]):
        """The planes of `seqs`, in that order: [elements of a plane, len(seqs)] (a copy)."""
        flat = ggml.ggml_reshape_2d(self.ctx, state_tensor, self._plane_elems(state_tensor), self.cache.n_seq)
        ids = self.constant("seqs." + ",".join(map(str, seqs)), I32, (len(seqs),), np.asarray(seqs))
        return ggml.ggml_get_rows(self.ctx, flat, ids)

    def scatter_planes(self, state_tensor, src, seqs: list[int]) -> None:
        """Write src [elements of a plane, len(seqs)] back as the planes of `seqs`."""
        flat = ggml.ggml_reshape_2d(self.ctx, state_tensor, self._plane_elems(state_tensor), self.cache.n_seq)
        src = ggml.ggml_cont(self.ctx, src) if not ggml.ggml_is_contiguous(src) else src
        src = ggml.ggml_reshape_2d(self.ctx, src, self._plane_elems(state_tensor), len(seqs))
        ids = self.constant("seqs." + ",".join(map(str, seqs)), I32, (len(seqs),), np.asarray(seqs))
        self.expand(ggml.ggml_set_rows(self.ctx, flat, src, ids))

    # ---- DSA ---------------------------------------------------------------------------------
    def dsa_top_k(self, layer: int) -> int | None:
        """The top-k of a DSA layer when DSA runs, else None (dense MLA)."""
        return self._top_k if self._top_k is not None and self.cfg.is_dsa(layer) else None

    # ---- shared numerics ---------------------------------------------------------------------
    def mm(self, w, x):
        """w x for a weight of any type; on the exact path the activations stay F32.

        ggml's CPU matmul converts the activations to the weight's vec_dot type first (BF16
        for BF16 weights, Q8 for quantized ones), which moves the result by ~0.2%. The exact
        path therefore multiplies F32 copies of the weight's rows, made inside the graph by
        get_rows (which dequantizes every type), at most DEQUANT_CHUNK_BYTES of them at a time:
        ggml-alloc frees each chunk after its matmul, so the scratch stays one chunk (the 4.7 GB
        output matrix of the real model included), while every call still pays one pass of
        dequantization over each non-F32 weight it uses.
        """
        if self.wants(taps.IMATRIX):
            taps.record_input_sq(self, w, x)
        if not self.exact or w.contents.type == F32:
            return ggml.ggml_mul_mat(self.ctx, w, x)
        n_in, n_rows = w.contents.ne[0], ggml.ggml_nrows(w)
        if ggml.ggml_n_dims(w) > 2:  # per-head batched weights (attn_k_b, attn_v_b): small
            f32 = self._f32_rows(ggml.ggml_reshape_2d(self.ctx, w, n_in, n_rows), 0, n_rows)
            return ggml.ggml_mul_mat(self.ctx, ggml.ggml_reshape_3d(self.ctx, f32, *w.contents.ne[:3]), x)
        step = max(1, DEQUANT_CHUNK_BYTES // (4 * n_in))
        out = None
        for r0 in range(0, n_rows, step):
            part = ggml.ggml_mul_mat(self.ctx, self._f32_rows(w, r0, min(step, n_rows - r0)), x)
            out = part if out is None else ggml.ggml_concat(self.ctx, out, part, 0)
        return out

    def _f32_rows(self, w, r0: int, n: int):
        """Rows r0 .. r0+n-1 of a 2-D weight as a new F32 tensor [ne0, n]."""
        nb1 = w.contents.nb[1]
        rows = ggml.ggml_view_2d(self.ctx, w, w.contents.ne[0], n, nb1, r0 * nb1)
        ids = self.constant(f"row_ids_{n}", I32, (n,), np.arange(n, dtype=np.int32))
        return ggml.ggml_get_rows(self.ctx, rows, ids)

    @property
    def qk_latent_eps(self) -> float:
        """The eps of the KDA q/k L2 norm and the MLA latent norms: the reference's (1e-6) on the
        exact path, llama.cpp's (rms_norm_eps) on the fast one, which is there to give the numbers
        llama.cpp gives for the same GGUF. 1e-5 against 1e-6 moves q/k by ~4e-6 relative: enough
        to flip activations across a BF16 rounding step in the next matmul (k3-tiny, layer 0:
        8e-5 relative instead of equal)."""
        return REFERENCE_QK_LATENT_EPS if self.exact else self.cfg.rms_norm_eps

    def rms_norm(self, x, weight, eps: float):
        """weight * x / sqrt(mean(x^2) + eps), over ne0."""
        return ggml.ggml_mul(self.ctx, ggml.ggml_rms_norm(self.ctx, x, eps), weight)
