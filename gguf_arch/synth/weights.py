"""Seeded random weights for a synthetic checkpoint, per tensor, as a stream of bytes.

Scales follow the shared fixtures (whose reference run showed O(1) activations and varied
logits): projections N(0, (gain / sqrt(fan_in))^2), norm gains 1 + 0.1 N, embeddings N(0, 1),
MXFP4 codes uniform over all 16 values with E8M0 scales around 2^-3 / sqrt(fan_in).

Every tensor draws from its own generator, seeded by (seed, tensor name), so its values do not
depend on file order. A tensor of at most POOL elements is fully random; a larger one repeats a
random pool of POOL values at random rotations, which keeps generation of multi-GB checkpoints
fast and memory bounded (the large preset is for benchmarks, its exact values matter little).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from ..arch.config import K3Config
from ..arch import tensors as T
from ..arch.tensors import TensorSpec

POOL = 1 << 20  # elements drawn per tensor at most


@dataclass(frozen=True)
class Init:
    """How one source tensor is stored and drawn.

    kind: proj (N(0, scale^2 / fan_in)), embed (N(0, scale^2)), gain (1 + scale N), bias (scale N),
    conv, a_log, mxfp4_packed, mxfp4_scale. dtype: the table's `Source.stored` for text tensors
    (`init_for` sets it), bf16 for the vision tensors the table does not hold.
    """

    kind: str
    scale: float = 1.0
    dtype: str = "BF16"


# Table rows whose sources are not drawn as a default projection (2-D, gain 1) or norm gain
# (1-D, 1 + 0.1 N). Keyed by the table's GGUF name templates.
ROW_INIT: dict[str, Init] = {
    T.TOKEN_EMBD: Init("embed"),
    T.OUTPUT: Init("proj", 3.0),
    T.ATTN_OUTPUT: Init("proj", 0.6),
    T.SSM_F_B: Init("proj", 0.8),
    T.SSM_DT: Init("bias", 0.45),
    T.INDEXER_K_NORM: Init("gain", 0.2),
    T.FFN_GATE: Init("proj", 1.5),
    T.FFN_UP: Init("proj", 1.5),
    T.FFN_GATE_INP: Init("proj", 2.0),
    T.EXP_PROBS_B: Init("bias", 0.15),
    T.FFN_ROUTED_DOWN: Init("proj", 1.5),
    T.FFN_ROUTED_UP: Init("proj", 0.7),
    T.FFN_GATE_SHEXP: Init("proj", 1.5),
    T.FFN_UP_SHEXP: Init("proj", 1.5),
}
# By transform: how the table's multi-source and special rows are drawn.
_TRANSFORM_INIT = {
    "reshape": Init("conv"),  # the q/k/v short convolutions
    "neg_exp_heads": Init("a_log"),
}
_RES_PROJ = Init("proj", 0.5)  # AttnRes pseudo-query [1, hidden]
_NORM = Init("gain", 0.1)
_PROJ = Init("proj")
# Per-head log-scales of either sign, bounded away from 0 (the padding after them is exactly 0).
_A_LOG_MAGNITUDE = (0.02, 0.8)


def init_for(spec: TensorSpec, source_index: int, shape: tuple[int, ...]) -> Init:
    """The init of source `source_index` of a table row, given its concrete shape, stored in the
    dtype the table gives that source."""
    return replace(_drawn(spec, source_index, shape), dtype=spec.sources[source_index].stored)


def _drawn(spec: TensorSpec, source_index: int, shape: tuple[int, ...]) -> Init:
    if spec.transform == "mxfp4_experts":
        return Init("mxfp4_packed" if source_index % 2 == 0 else "mxfp4_scale")
    if spec.transform in _TRANSFORM_INIT:
        return _TRANSFORM_INIT[spec.transform]
    if spec.transform == "res_score":
        return _NORM if len(shape) == 1 else _RES_PROJ
    return ROW_INIT.get(spec.gguf, default_init(shape))


def default_init(shape: tuple[int, ...]) -> Init:
    """A norm gain for a vector, a projection otherwise (bf16 unless `init_for` says otherwise)."""
    return _NORM if len(shape) == 1 else _PROJ


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()
    words = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]
    return np.random.default_rng([seed, *words])


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest, ties to even."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)


def mxfp4_scale_range(fan_in: int) -> tuple[int, int]:
    """Inclusive E8M0 byte range as the fixtures use: with uniform codes (rms 2.93) the weights'
    rms is 1.2 to 2.4 / sqrt(fan_in), like the bf16 projections' gains."""
    lo = math.floor(math.log2(1.0 / math.sqrt(fan_in)) - 2.5) + 127
    return lo, lo + 3


def _floats(init: Init, shape: tuple[int, ...], n: int, cfg: K3Config, rng: np.random.Generator) -> np.ndarray:
    if init.kind == "a_log":
        out = np.zeros(n, np.float32)
        heads = cfg.kda.num_heads
        signs = rng.choice(np.array([-1.0, 1.0], np.float32), heads)
        out[:heads] = signs * rng.uniform(*_A_LOG_MAGNITUDE, heads)
        return out
    z = rng.standard_normal(n, dtype=np.float32)
    if init.kind == "proj":
        return z * np.float32(init.scale / math.sqrt(shape[-1]))
    if init.kind == "gain":
        return 1 + np.float32(init.scale) * z
    if init.kind == "conv":
        return np.float32(0.2) + np.float32(0.5) * z
    return z * np.float32(init.scale)  # embed, bias


def _pool(init: Init, shape: tuple[int, ...], n: int, cfg: K3Config, rng: np.random.Generator) -> np.ndarray:
    if init.kind == "mxfp4_packed":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if init.kind == "mxfp4_scale":
        lo, hi = mxfp4_scale_range(shape[-1] * cfg.mxfp4_group_size)
        return rng.integers(lo, hi + 1, n, dtype=np.uint8)
    values = _floats(init, shape, n, cfg, rng)
    return values if init.dtype == "F32" else to_bf16(values)


def tensor_chunks(seed: int, name: str, shape: tuple[int, ...], init: Init, cfg: K3Config) -> Iterator[memoryview]:
    """The tensor's bytes, row-major, in pieces of at most POOL elements."""
    n = math.prod(shape)
    if n == 0:
        return
    rng = tensor_rng(seed, name)
    pool = _pool(init, shape, min(n, POOL), cfg, rng)
    left = n
    while left:
        start = int(rng.integers(len(pool))) if n > len(pool) else 0
        for piece in (pool[start:], pool[:start]):
            piece = piece[:left]
            if len(piece):
                left -= len(piece)
                yield memoryview(piece).cast("B")
