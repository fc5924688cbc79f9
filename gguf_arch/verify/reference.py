"""Reference forms: each GGUF tensor recomputed from its checkpoint sources, for the tensor diff.

Small forms of their own (per-head slicing for kv_b, float64 `-exp` for ssm_a, the MXFP4 values
E2M1 x 2^(e-127) for the routed experts), independent of the converter's write path: this module
imports no transform, no repack and no writer (tests/gguf_arch/verify/test_diff.py checks), only
the formats' facts (`arch.mxfp4`, `io.safetensors`). Each form yields the expected tensor as
float32 rows of its [rows, ne0] view, in bounded chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..arch.config import K3Config
from ..arch.mxfp4 import BLOCK, dequantize_compressed
from ..arch.tensors import OUT_F32, OUT_MXFP4, OUT_SOURCE, PlannedTensor
from ..io.safetensors import to_f32

CHUNK_ELEMS = 1 << 22  # expected values materialised at once (16 MiB of float32)


@dataclass(frozen=True)
class Source:
    name: str
    dtype: str  # safetensors dtype name
    array: np.ndarray  # memory-mapped; BF16 as raw uint16 bit patterns


def as_f32(src: Source, part: np.ndarray | None = None) -> np.ndarray:
    """Source values (or a part of them) as float32, exactly."""
    return to_f32(src.dtype, src.array if part is None else part)


@dataclass(frozen=True)
class Chunk:
    row: int  # first row in the GGUF tensor viewed as [prod(shape[:-1]), shape[-1]]
    values: np.ndarray  # float32 [n_rows, ne0]
    unit: str | None = None  # compared and reported on its own ("expert 3")


Reference = Callable[[K3Config, PlannedTensor, list[Source]], Iterator[Chunk]]


def _same_order(cfg: K3Config, plan: PlannedTensor, src: list[Source]) -> Iterator[Chunk]:
    """copy and reshape: the GGUF holds the source's elements in the source's C order."""
    ne0 = plan.shape[-1]
    rows = src[0].array.reshape(-1, ne0)
    step = max(1, CHUNK_ELEMS // ne0)
    for r in range(0, len(rows), step):
        yield Chunk(r, as_f32(src[0], rows[r: r + step]))


def _neg_exp_heads(cfg: K3Config, plan: PlannedTensor, src: list[Source]) -> Iterator[Chunk]:
    # float64 then one rounding: the correctly rounded float32, whichever exp the converter used.
    a_log = as_f32(src[0])[: cfg.kda.num_heads].astype(np.float64)
    yield Chunk(0, (-np.exp(a_log)).astype(np.float32)[None, :])


def _res_score(cfg: K3Config, plan: PlannedTensor, src: list[Source]) -> Iterator[Chunk]:
    # The product of two float32 is exact in float64, so this is the one correctly rounded value.
    norm, proj = (as_f32(s).astype(np.float64).ravel() for s in src)
    yield Chunk(0, (norm * proj).astype(np.float32)[None, :])


def _kv_b_heads(cfg: K3Config, src: Source) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """kv_b rows per head h: [h*(nope+v), (h+1)*(nope+v)), first the k_nope rows, then the v rows."""
    per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
    for h in range(cfg.num_heads):
        rows = as_f32(src, src.array[h * per_head: (h + 1) * per_head])
        yield h, rows[: cfg.qk_nope_head_dim], rows[cfg.qk_nope_head_dim:]


def _kv_b_k(cfg: K3Config, plan: PlannedTensor, src: list[Source]) -> Iterator[Chunk]:
    for h, k_rows, _ in _kv_b_heads(cfg, src[0]):
        yield Chunk(h * cfg.kv_lora_rank, np.ascontiguousarray(k_rows.T))  # [kv_lora, nope]: latent as rows


def _kv_b_v(cfg: K3Config, plan: PlannedTensor, src: list[Source]) -> Iterator[Chunk]:
    for h, _, v_rows in _kv_b_heads(cfg, src[0]):
        yield Chunk(h * cfg.v_head_dim, v_rows)


_E8M0_NAN = 255  # the OCP MX spec's NaN scale; ggml reads it as 2^128


def decode_compressed_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors `weight_packed` [rows, cols/2] + `weight_scale` [rows, cols/32] -> float32:
    the format's values (`mxfp4.dequantize_compressed`), NaN where the scale is E8M0's NaN."""
    values = dequantize_compressed(packed, scale)
    nan_blocks = np.repeat(scale == _E8M0_NAN, BLOCK, axis=1)
    return np.where(nan_blocks, np.float32(np.nan), values)


def _mxfp4_experts(cfg: K3Config, plan: PlannedTensor, src: list[Source]) -> Iterator[Chunk]:
    rows = plan.shape[1]
    for e in range(cfg.num_experts):
        packed, scale = src[2 * e], src[2 * e + 1]
        yield Chunk(e * rows, decode_compressed_mxfp4(np.asarray(packed.array), np.asarray(scale.array)),
                    f"expert {e}")


REFERENCES: dict[str, Reference] = {
    "copy": _same_order,
    "reshape": _same_order,
    "neg_exp_heads": _neg_exp_heads,
    "res_score": _res_score,
    "kv_b_k": _kv_b_k,
    "kv_b_v": _kv_b_v,
    "mxfp4_experts": _mxfp4_experts,
}


def exact_type(plan: PlannedTensor, sources: list[Source]) -> Q:
    """The GGUF type the table gives this tensor when nothing is quantized."""
    out = plan.spec.out
    if out == OUT_F32:
        return Q.F32
    if out == OUT_MXFP4:
        return Q.MXFP4
    assert out == OUT_SOURCE, out
    return Q[sources[0].dtype]
