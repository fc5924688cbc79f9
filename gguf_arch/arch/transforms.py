"""The K3 transforms (docs/reference/gguf.md, Tensors and Indexer tensors): source tensors -> the bytes
of one GGUF tensor.

Each transform reads its sources through `read(name) -> (safetensors dtype, raw numpy view)` and
yields the output tensor's bytes in order as bounded chunks. A same-precision copy yields slices of
the source read in bounded ranges, so a 12288 x 7168 bf16 projection is streamed, never held whole; only
the small per-layer tensors that need arithmetic (A_log, AttnRes scores, kv_b halves, f32 casts)
and one expert matrix at a time are materialised.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..errors import CheckpointError
from .mxfp4 import repack_to_ggml
from ..io.console import cpu_count
from ..io.pipeline import ahead
from ..io.safetensors import ShardArray, to_f32
from .tensors import PlannedTensor

Read = Callable[[str], tuple[str, np.ndarray]]
Chunks = Iterator[memoryview]  # flat uint8 views

# 16 MiB: below glibc's largest mmap threshold (32 MiB), so the pread buffers of a stream are
# reused heap memory; fresh 64 MiB buffers cost twice the CPU in page faults (measured 0.34 vs
# 0.16 CPU-s per GB read from the page cache).
CHUNK_BYTES = 16 * 1024 * 1024
# Experts repacked ahead of the writer: a real expert matrix is 5.8 MB, so a few dozen MB at most.
REPACK_AHEAD = min(8, cpu_count())

# Source dtype -> the GGML type that holds its bytes unchanged.
SAME_BYTES: dict[str, Q] = {"BF16": Q.BF16, "F16": Q.F16, "F32": Q.F32}


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """The array's bytes as flat uint8 (a view when it is already contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _flat(a: np.ndarray | ShardArray) -> np.ndarray | ShardArray:
    """The values in C order, flat; a tensor not yet read stays unread (its slices are read)."""
    return a.reshape(-1) if isinstance(a, ShardArray) else np.ascontiguousarray(a).reshape(-1)


def _byte_chunks(a: np.ndarray | ShardArray) -> Chunks:
    flat = _flat(a)
    step = max(1, CHUNK_BYTES // flat.dtype.itemsize)
    if isinstance(flat, ShardArray):  # read ahead as the checkpoint allows, straight into the written buffer
        for chunk in flat.flat_chunks(step):
            yield memoryview(chunk.view(np.uint8))
        return
    for start in range(0, flat.size, step):
        yield memoryview(np.asarray(flat[start:start + step]).view(np.uint8))


def _cast_chunks(dtype: str, a: np.ndarray | ShardArray, out: Q) -> Chunks:
    """The array's bytes at the output type: passthrough when it already is that type."""
    if SAME_BYTES.get(dtype) == out:
        yield from _byte_chunks(a)
        return
    if out != Q.F32:
        raise ValueError(f"no conversion from {dtype} to {out.name}")
    flat = _flat(a)
    step = CHUNK_BYTES // 4
    for start in range(0, flat.size, step):
        yield memoryview(_flat_bytes(to_f32(dtype, flat[start:start + step])))


def _only(pt: PlannedTensor) -> str:
    return pt.sources[0][0]


def copy(pt: PlannedTensor, out: Q, read: Read) -> Chunks:
    """Same values; a reshape (conv1d [P,1,K] -> (1,P,1,K)) keeps the row-major bytes too."""
    dtype, a = read(_only(pt))
    return _cast_chunks(dtype, a, out)


def neg_exp_heads(pt: PlannedTensor, out: Q, read: Read) -> Chunks:
    """ssm_a = -exp(A_log[:num_heads]) in f32; the rest of A_log must be the zero padding."""
    name = _only(pt)
    dtype, a = read(name)
    values = to_f32(dtype, a)
    heads = pt.shape[0]
    bad = np.flatnonzero(values[heads:]) + heads
    if bad.size:
        raise CheckpointError(f"{name}: entries {heads}..{values.size - 1} must be zero padding (only the first "
                              f"{heads} are per-head log-scales), found non-zero values at {bad[:8].tolist()}")
    # exp in float64 rounded once: the correctly rounded f32 value (numpy's f32 exp is off by one
    # ulp on about a third of inputs), and bit-equal to llama.cpp's converter on the fixtures.
    with np.errstate(over="ignore"):  # an overflow to -inf is reported by the non-finite scan, by name
        ssm_a = (-np.exp(values[:heads].astype(np.float64))).astype(np.float32)
    return _cast_chunks("F32", ssm_a, out)


def res_score(pt: PlannedTensor, out: Q, read: Read) -> Chunks:
    """AttnRes: RMSNorm gain x pseudo-query, one f32 score vector."""
    (norm_dt, norm), (proj_dt, proj) = (read(name) for name, _ in pt.sources)
    return _cast_chunks("F32", to_f32(norm_dt, norm) * to_f32(proj_dt, proj).reshape(-1), out)


def kv_b_k(pt: PlannedTensor, out: Q, read: Read) -> Chunks:
    """k_b = kv_b viewed [NH, nope+v, kv_lora], rows [:nope], transposed to (NH, kv_lora, nope)."""
    heads, lora, nope = pt.shape
    dtype, a = read(_only(pt))
    per_head = a.reshape(heads, -1, lora)
    return _cast_chunks(dtype, per_head[:, :nope, :].transpose(0, 2, 1), out)


def kv_b_v(pt: PlannedTensor, out: Q, read: Read) -> Chunks:
    """v_b = kv_b viewed [NH, nope+v, kv_lora], rows [nope:] -> (NH, v, kv_lora)."""
    heads, v, lora = pt.shape
    dtype, a = read(_only(pt))
    per_head = a.reshape(heads, -1, lora)
    return _cast_chunks(dtype, per_head[:, per_head.shape[1] - v:, :], out)


def _repack(pair: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    return _flat_bytes(repack_to_ggml(*pair))


def mxfp4_experts(pt: PlannedTensor, out: Q, read: Read, threads: int | None = None) -> Chunks:
    """[n_expert, rows, cols] block_mxfp4, yielded one expert at a time (bounded memory).

    The nibble work of the next few experts runs on worker threads (numpy releases the GIL), so a
    many-core machine repacks in parallel; only views are taken on the caller's thread. `threads`:
    how many (the converter's -j; None: REPACK_AHEAD).
    """
    if out != Q.MXFP4:
        raise ValueError(f"{pt.name}: routed experts are written as MXFP4, not {out.name}")
    names = [name for name, _ in pt.sources]
    pairs = ((np.asarray(read(p)[1]), np.asarray(read(s)[1])) for p, s in zip(names[0::2], names[1::2]))
    for block in ahead(_repack, pairs, threads or REPACK_AHEAD):
        yield memoryview(block)


TRANSFORMS: dict[str, Callable[[PlannedTensor, Q, Read], Chunks]] = {
    "copy": copy,
    "reshape": copy,
    "neg_exp_heads": neg_exp_heads,
    "res_score": res_score,
    "kv_b_k": kv_b_k,
    "kv_b_v": kv_b_v,
    "mxfp4_experts": mxfp4_experts,
}


def tensor_chunks(pt: PlannedTensor, out: Q, read: Read, threads: int | None = None) -> Chunks:
    """The bytes of GGUF tensor `pt` at type `out`, in file order; `threads` bounds the experts
    repacked at once (the only transform with work worth spreading over cores)."""
    if pt.transform == "mxfp4_experts":
        return mxfp4_experts(pt, out, read, threads)
    return TRANSFORMS[pt.transform](pt, out, read)
