"""Tensor diff: each GGUF tensor of the chosen layers against the HF checkpoint it came from.

Every expected tensor is recomputed here from the safetensors bytes with small reference forms of
its own (per-head slicing for kv_b, float64 `-exp` for ssm_a, an E2M1 x 2^(e-127) decoder for the
routed experts). This module imports neither `transforms`, `mxfp4` nor `writer`, so a bug in the
converter's write path cannot also be in the check that is meant to catch it. The GGUF is read with
gguf-py's GGUFReader and decoded with gguf-py's own dequantizers.

Verdicts per tensor:
  exact         the GGUF type is the table's output type and every value is equal (floats: also
                the sign of zero; MXFP4: the decoded values, since ggml's table has no -0)
  within_bound  the GGUF holds another type (a quantized trunk, issue 4): its dequantized values
                are within that type's rounding bound of the source (see `_BOUNDS`)
  mismatch      a value differs; the first one is reported (per expert for stacked experts)
  missing / unexpected / type / shape   as the names say

Memory stays bounded: tensors are compared in row chunks, stacked experts one expert at a time.
Exit codes follow cmp(1): 0 every tensor matches, 1 a difference, 2 bad input (errors.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import mmap
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize

from .config import K3Config, load_config
from .console import ArgumentParser, task_bar
from .errors import CheckpointError, KimiError, run_cli
from .gguf_file import open_gguf
from .tensors import OUT_F32, OUT_MXFP4, OUT_SOURCE, TABLE, PlannedTensor, plan_tensors

DIFFERENCES_EXIT = 1
_CHUNK_ELEMS = 1 << 22  # expected values materialised at once (16 MiB of float32)
_MAX_UNITS_SHOWN = 8  # failing experts named in one line

# ---- HF side: the checkpoint's bytes --------------------------------------------------------

_ST_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "U8": np.dtype("u1")}


@dataclass(frozen=True)
class _Source:
    name: str
    dtype: str  # safetensors dtype name
    array: np.ndarray  # memory-mapped; BF16 as raw uint16 bit patterns


class _Checkpoint:
    """Tensors read straight from the shards' memory maps.

    safetensors' numpy backend has no bfloat16 and its API exposes no data offsets, so the
    documented header (u64 length + JSON of dtype/shape/data_offsets) is parsed here.
    """

    def __init__(self, model_dir: Path):
        self.dir = model_dir
        self._shard_of = self._weight_map()
        self._shards: dict[str, tuple[dict, np.memmap, int]] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: no readable weight_map: {exc}") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map must be an object")
            return weight_map
        single = "model.safetensors"
        if (self.dir / single).is_file():
            return {name: single for name in self._shard(single)[0] if name != "__metadata__"}
        raise CheckpointError(f"{self.dir}: neither model.safetensors.index.json nor model.safetensors found")

    def _shard(self, shard: str) -> tuple[dict, np.memmap, int]:
        if shard not in self._shards:
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise CheckpointError(f"{self.dir}: shard name {shard!r} is not a plain file name in the model directory")
            self._shards[shard] = _read_shard(self.dir / shard)
        return self._shards[shard]

    def has(self, name: str) -> bool:
        return name in self._shard_of

    def release_pages(self) -> None:
        for _, data, _ in self._shards.values():
            _drop_resident_pages(data)

    def get(self, name: str, shape: tuple[int, ...], dtypes: Iterable[str]) -> _Source:
        if name not in self._shard_of:
            raise CheckpointError(f"{self.dir}: tensor {name} is not in the checkpoint")
        shard = self._shard_of[name]
        header, data, base = self._shard(shard)
        info = header.get(name)
        where = f"{self.dir / shard}: tensor {name}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where} is not in the shard's header")
        dtype, got_shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in dtypes or dtype not in _ST_DTYPES:
            raise CheckpointError(f"{where} has dtype {dtype!r}, expected one of {sorted(dtypes)}")
        if not isinstance(got_shape, list) or tuple(got_shape) != shape:
            raise CheckpointError(f"{where} has shape {got_shape}, the config implies {list(shape)}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[dtype].itemsize
        if (not isinstance(offsets, list) or len(offsets) != 2 or offsets[1] - offsets[0] != nbytes
                or offsets[0] < 0 or base + offsets[1] > len(data)):
            raise CheckpointError(f"{where} has data_offsets {offsets}, which do not hold {nbytes} bytes inside the file")
        raw = data[base + offsets[0]: base + offsets[1]]
        return _Source(name, dtype, raw.view(_ST_DTYPES[dtype]).reshape(shape))


def _drop_resident_pages(data: np.memmap) -> None:
    """Unmap this process's resident pages of a read-only map (they stay in the page cache and
    fault back in when touched). np.memmap keeps its mmap.mmap as the array's base."""
    data.base.madvise(mmap.MADV_DONTNEED)


def _read_shard(path: Path) -> tuple[dict, np.memmap, int]:
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from None
    n = int(data[:8].view("<u8")[0]) if len(data) >= 8 else -1
    if not 0 < n <= len(data) - 8:
        raise CheckpointError(f"{path}: not a safetensors file (header length {n}, file size {len(data)})")
    try:
        header = json.loads(bytes(data[8: 8 + n]))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    return header, data, 8 + n


def _as_f32(src: _Source, part: np.ndarray | None = None) -> np.ndarray:
    """Source values as float32, exactly: a bf16 is the top half of the float32 with its bits."""
    a = src.array if part is None else part
    if src.dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if src.dtype == "U8":
        raise CheckpointError(f"tensor {src.name} is U8; a float tensor is expected here")
    return a.astype(np.float32)


# ---- reference forms: the expected GGUF tensor, as rows of its [rows, ne0] view ---------------

@dataclass(frozen=True)
class _Chunk:
    row: int  # first row in the GGUF tensor viewed as [prod(shape[:-1]), shape[-1]]
    values: np.ndarray  # float32 [n_rows, ne0]
    unit: str | None = None  # compared and reported on its own ("expert 3")


Reference = Callable[[K3Config, PlannedTensor, list[_Source]], Iterator[_Chunk]]


def _same_order(cfg: K3Config, plan: PlannedTensor, src: list[_Source]) -> Iterator[_Chunk]:
    """copy and reshape: the GGUF holds the source's elements in the source's C order."""
    ne0 = plan.shape[-1]
    rows = src[0].array.reshape(-1, ne0)
    step = max(1, _CHUNK_ELEMS // ne0)
    for r in range(0, len(rows), step):
        yield _Chunk(r, _as_f32(src[0], rows[r: r + step]))


def _neg_exp_heads(cfg: K3Config, plan: PlannedTensor, src: list[_Source]) -> Iterator[_Chunk]:
    # float64 then one rounding: the correctly rounded float32, whichever exp the converter used.
    a_log = _as_f32(src[0])[: cfg.kda.num_heads].astype(np.float64)
    yield _Chunk(0, (-np.exp(a_log)).astype(np.float32)[None, :])


def _res_score(cfg: K3Config, plan: PlannedTensor, src: list[_Source]) -> Iterator[_Chunk]:
    # The product of two float32 is exact in float64, so this is the one correctly rounded value.
    norm, proj = (_as_f32(s).astype(np.float64).ravel() for s in src)
    yield _Chunk(0, (norm * proj).astype(np.float32)[None, :])


def _kv_b_heads(cfg: K3Config, src: _Source) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """kv_b rows per head h: [h*(nope+v), (h+1)*(nope+v)), first the k_nope rows, then the v rows."""
    per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
    for h in range(cfg.num_heads):
        rows = _as_f32(src, src.array[h * per_head: (h + 1) * per_head])
        yield h, rows[: cfg.qk_nope_head_dim], rows[cfg.qk_nope_head_dim:]


def _kv_b_k(cfg: K3Config, plan: PlannedTensor, src: list[_Source]) -> Iterator[_Chunk]:
    for h, k_rows, _ in _kv_b_heads(cfg, src[0]):
        yield _Chunk(h * cfg.kv_lora_rank, np.ascontiguousarray(k_rows.T))  # [kv_lora, nope]: latent as rows


def _kv_b_v(cfg: K3Config, plan: PlannedTensor, src: list[_Source]) -> Iterator[_Chunk]:
    for h, _, v_rows in _kv_b_heads(cfg, src[0]):
        yield _Chunk(h * cfg.v_head_dim, v_rows)


# compressed-tensors FP4 E2M1 by nibble; bit 3 is the sign (k3-spec C.2).
_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
# A packed byte holds element 2i in its low nibble and 2i+1 in its high nibble: byte -> that pair.
_BYTE_PAIRS = np.stack([_E2M1[np.arange(256) & 0x0F], _E2M1[np.arange(256) >> 4]], axis=1)
_E8M0_NAN = 255


def decode_compressed_mxfp4(packed: np.ndarray, scale: np.ndarray, group: int = 32) -> np.ndarray:
    """compressed-tensors `weight_packed` [rows, cols/2] + `weight_scale` [rows, cols/group] -> float32.

    w = E2M1[code] * 2^(scale - 127); both factors and their product are exact in float32.
    """
    rows, n_groups = scale.shape
    exponent = np.minimum(scale, _E8M0_NAN - 1).astype(np.int32) - 127
    factor = np.where(scale == _E8M0_NAN, np.float32(np.nan), np.ldexp(np.float32(1), exponent)).astype(np.float32)
    return (_BYTE_PAIRS[packed].reshape(rows, n_groups, group) * factor[:, :, None]).reshape(rows, -1)


def _mxfp4_experts(cfg: K3Config, plan: PlannedTensor, src: list[_Source]) -> Iterator[_Chunk]:
    rows = plan.shape[1]
    for e in range(cfg.num_experts):
        packed, scale = src[2 * e], src[2 * e + 1]
        yield _Chunk(e * rows, decode_compressed_mxfp4(np.asarray(packed.array), np.asarray(scale.array),
                                                       cfg.mxfp4_group_size), f"expert {e}")


REFERENCES: dict[str, Reference] = {
    "copy": _same_order,
    "reshape": _same_order,
    "neg_exp_heads": _neg_exp_heads,
    "res_score": _res_score,
    "kv_b_k": _kv_b_k,
    "kv_b_v": _kv_b_v,
    "mxfp4_experts": _mxfp4_experts,
}


def exact_type(plan: PlannedTensor, sources: list[_Source]) -> Q:
    """The GGUF type the table gives this tensor when nothing is quantized."""
    out = plan.spec.out
    if out == OUT_F32:
        return Q.F32
    if out == OUT_MXFP4:
        return Q.MXFP4
    assert out == OUT_SOURCE, out
    return Q[sources[0].dtype]


# ---- error bounds of types other than the exact one ------------------------------------------

def _f32_bound(x: np.ndarray) -> np.ndarray:
    return np.zeros_like(x)  # every source (bf16, f16, f32) widens to float32 exactly


def _f16_bound(x: np.ndarray) -> np.ndarray:
    # round to nearest: half an ulp, 2^-11 relative for normals, 2^-25 absolute in the subnormals.
    return np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -25)


def _bf16_bound(x: np.ndarray) -> np.ndarray:
    # round to nearest with 8 significant bits: half an ulp <= 2^-8 relative (2^-134 subnormal).
    return np.maximum(np.abs(x) * 2.0 ** -8, 2.0 ** -134)


def _q8_0_bound(x: np.ndarray) -> np.ndarray:
    # Q8_0 (ggml quantize_row_q8_0): per 32-block d = max|x| / 127, q = round(x / d), stored q * f16(d).
    # |err| <= d/2 (rounding q) + 127 * |f16(d) - d|, with |f16(d) - d| <= max(d * 2^-11, 2^-25)
    # (f16 rounding, normal / subnormal); 2^-16 relative slack covers the float32 x * (1/d).
    blocks = np.abs(x.astype(np.float64)).reshape(-1, 32)
    d = blocks.max(axis=1, keepdims=True) / 127
    bound = (d / 2 + 127 * np.maximum(d * 2.0 ** -11, 2.0 ** -25)) * (1 + 2.0 ** -16)
    return np.broadcast_to(bound, blocks.shape).reshape(x.shape)


# The 4- and 5-bit types and MXFP4 below, as ggml's reference quantizers (quantize_row_*_ref, which
# gguf-py's quants reproduce byte for byte) choose them, per block of 32 values. Each bound is half
# a quantization step where the code is rounded to nearest, the clipped distance where ggml clips,
# plus the f16 rounding of the stored scale / min, plus _STEP_SLACK of a step for the quantizer's
# float32 arithmetic (x * (1/d) rounded can pick the farther of two codes by ~2^-18 of a step).
# Where a step is resolvable (the f16 scale is normal and, for Q4_1/Q5_1, |min| is at most the block's
# range, as in weight blocks that straddle zero; MXFP4 always), a code one step away from the source
# value is caught (its error is a step plus the rounding error), and one step towards it unless the
# value sat within a few hundredths of a step of a rounding midpoint, where either code is as good.
# The f16 terms assume |scale|, |min| <= 65504 (an overflowed f16 is inf: caught).
_STEP_SLACK = 2.0 ** -12


def _blocks_of_32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64).reshape(-1, 32)


def _symmetric_bound(levels: int) -> Callable[[np.ndarray], np.ndarray]:
    """Q4_0 (levels 8), Q5_0 (16): d = m / -levels with m the block's value of largest magnitude
    (the first such), code q = trunc(x / d + levels + 0.5) clipped to [0, 2 levels - 1], stored
    (q - levels) * f16(d). With t = x / d in [-levels, levels] the code q - levels is t rounded to
    nearest, except that t > levels - 1/2 (only values of the opposite sign to m) is clipped to
    levels - 1: |err| <= |d| * max(1/2, t - (levels - 1)) + levels * |f16(d) - d|."""
    def bound(x: np.ndarray) -> np.ndarray:
        blocks = _blocks_of_32(x)
        m = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        step = np.abs(m) / levels
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(m == 0, 0.0, -levels * blocks / m)
        rounding = step * (np.maximum(0.5, t - (levels - 1)) + _STEP_SLACK)
        return (rounding + levels * _f16_bound(step)).reshape(x.shape)
    return bound


def _offset_bound(levels: int) -> Callable[[np.ndarray], np.ndarray]:
    """Q4_1 (levels 15), Q5_1 (31): d = (max - min) / levels, q = round((x - min) / d) in
    [0, levels] (never clipped), stored q * f16(d) + f16(min):
    |err| <= d/2 + levels * |f16(d) - d| + |f16(min) - min|. (A block far from zero, |min| >> max - min,
    is as coarse as f16(min): that is the format's limit, and the bound says so.)"""
    def bound(x: np.ndarray) -> np.ndarray:
        blocks = _blocks_of_32(x)
        low = blocks.min(axis=1, keepdims=True)
        step = (blocks.max(axis=1, keepdims=True) - low) / levels
        per_block = step * (0.5 + _STEP_SLACK) + levels * _f16_bound(step) + _f16_bound(low)
        return np.broadcast_to(per_block, blocks.shape).reshape(x.shape)
    return bound


def _e2m1_rounding(u: np.ndarray) -> np.ndarray:
    """Largest distance from u >= 0 to the E2M1 magnitude nearest it (0, .5 .. 2 step .5, 3, 4, 6):
    half the local spacing; above 6, the clipped distance u - 6."""
    return np.select([u <= 2, u <= 4, u <= 6], [0.25, 0.5, 1.0], u - 6)


def _mxfp4_bound(x: np.ndarray) -> np.ndarray:
    """MXFP4 (ggml quantize_row_mxfp4_ref): the E8M0 shared exponent gives the scale
    s = 2^(floor(log2 max|x|) - 2), so max|x| / s is in [4, 8); each value is the E2M1 code nearest x / s
    (magnitudes up to 6, so the block's largest values are clipped by up to 2 s), stored exactly
    as E2M1 * s: no scale rounding. |err| <= s * _e2m1_rounding(|x| / s).

    ggml takes floor(log2f(max)) in float32, which rounds a max just below a power of two (within
    half a float32 ulp of log2: at most ~2^-18 relative) up to it and so uses the next exponent;
    blocks whose max is within 2^-14 below a power of two get the larger of both bounds. The bound
    assumes max|x| is 0 or at least 2^-125: below that ggml's exponent byte wraps around."""
    blocks = np.abs(_blocks_of_32(x))
    amax = blocks.max(axis=1, keepdims=True)
    _, exp = np.frexp(amax)  # amax = f * 2^exp, f in [0.5, 1): floor(log2 amax) = exp - 1
    scale = np.ldexp(1.0, exp - 3)
    bound = scale * (_e2m1_rounding(blocks / scale) + _STEP_SLACK)
    rounded_up = amax >= np.ldexp(1 - 2.0 ** -14, exp)
    bound = np.where(rounded_up, np.maximum(bound, 2 * scale * (_e2m1_rounding(blocks / (2 * scale)) + _STEP_SLACK)),
                     bound)
    return np.where(amax > 0, bound, 0.0).reshape(x.shape)


_BOUNDS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: _f32_bound, Q.F16: _f16_bound, Q.BF16: _bf16_bound, Q.Q8_0: _q8_0_bound,
    Q.Q4_0: _symmetric_bound(8), Q.Q5_0: _symmetric_bound(16),
    Q.Q4_1: _offset_bound(15), Q.Q5_1: _offset_bound(31), Q.MXFP4: _mxfp4_bound,
}

# ---- the comparison ------------------------------------------------------------------------

EXACT, WITHIN_BOUND, MISMATCH = "exact", "within_bound", "mismatch"
MISSING, UNEXPECTED, TYPE, SHAPE = "missing", "unexpected", "type", "shape"
OK_STATUSES = frozenset({EXACT, WITHIN_BOUND})


@dataclass(frozen=True)
class Mismatch:
    flat: int  # index into the GGUF tensor's elements in numpy (C) order
    coords: tuple[int, ...]  # the same in the GGUF numpy shape
    expected: float
    found: float
    unit: str | None = None

    def describe(self) -> str:
        where = f"{self.unit}: " if self.unit else ""
        return (f"{where}first mismatch at {list(self.coords)} (flat {self.flat}): "
                f"expected {np.float32(self.expected)!s}, found {np.float32(self.found)!s}")


@dataclass(frozen=True)
class TensorDiff:
    name: str
    layer: int | None
    status: str
    detail: str = ""
    gguf_type: str | None = None
    table_type: str | None = None  # the type the table gives it unquantized
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    def line(self) -> str:
        return f"{self.name}  {self.status.upper() if not self.ok else self.status}" + \
            (f"  {self.detail}" if self.detail else "")


@dataclass
class DiffReport:
    model_dir: str
    gguf: str
    layers: tuple[int, ...]
    tensors: list[TensorDiff] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tensors)

    def counts(self) -> dict[str, int]:
        order = (EXACT, WITHIN_BOUND, MISMATCH, MISSING, UNEXPECTED, TYPE, SHAPE)
        return {s: sum(t.status == s for t in self.tensors) for s in order}

    def summary(self) -> str:
        counts = self.counts()
        parts = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in counts.items() if n or s == EXACT)
        verdict = "all match" if self.ok else "DIFFERENT"
        return f"{len(self.tensors)} tensors over {len(self.layers)} layers: {parts}: {verdict}"

    def to_json(self) -> dict:
        return {"model_dir": self.model_dir, "gguf": self.gguf, "layers": list(self.layers), "ok": self.ok,
                "counts": self.counts(), "tensors": [asdict(t) for t in self.tensors]}


class _GGUF:
    """The GGUF's tensors by name, and their bytes one row range at a time."""

    def __init__(self, path: Path):
        self.reader = open_gguf(path)
        self.tensors = {t.name: t for t in self.reader.tensors}

    def rows(self, name: str, first: int, count: int) -> np.ndarray:
        t = self.tensors[name]
        ne0 = int(t.shape[0])
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        row_bytes = ne0 // block * size
        start = t.data_offset + first * row_bytes
        return np.asarray(self.reader.data[start: start + count * row_bytes]).reshape(count, row_bytes)

    def release_pages(self) -> None:
        _drop_resident_pages(self.reader.data)


def _releasing(chunks: Iterable[_Chunk], ckpt: _Checkpoint, gguf: _GGUF) -> Iterator[_Chunk]:
    """Pass chunks through; once one is compared, drop the pages it read from both files. Without
    this every page read stays in the RSS: a whole-model diff would hold the model and the GGUF."""
    for chunk in chunks:
        yield chunk
        ckpt.release_pages()
        gguf.release_pages()


def _first_mismatch(plan: PlannedTensor, chunk: _Chunk, bad: np.ndarray, expected: np.ndarray,
                    found: np.ndarray) -> Mismatch:
    r, c = np.unravel_index(int(np.argmax(bad)), bad.shape)
    flat = (chunk.row + int(r)) * plan.shape[-1] + int(c)
    coords = tuple(int(i) for i in np.unravel_index(flat, plan.shape))
    return Mismatch(flat, coords, float(expected[r, c]), float(found[r, c]), chunk.unit)


def _bad_values(expected: np.ndarray, found: np.ndarray, qtype: Q, exact: bool) -> np.ndarray:
    both_nan = np.isnan(expected) & np.isnan(found)
    if not exact:
        with np.errstate(invalid="ignore"):
            return ~(both_nan | (np.abs(found.astype(np.float64) - expected) <= _BOUNDS[qtype](expected)))
    same = (found == expected) | both_nan
    if qtype != Q.MXFP4:  # ggml's MXFP4 table has no -0; the float types keep the sign of zero
        same &= np.signbit(found) == np.signbit(expected)
    return ~same


def _compare(gguf: _GGUF, plan: PlannedTensor, chunks: Iterable[_Chunk], qtype: Q, exact: bool) -> list[Mismatch]:
    """First mismatch of the tensor, or of each unit (expert) when the chunks name units."""
    found_bad: list[Mismatch] = []
    for chunk in chunks:
        found = dequantize(gguf.rows(plan.name, chunk.row, len(chunk.values)), qtype)
        bad = _bad_values(chunk.values, found.reshape(chunk.values.shape), qtype, exact)
        if bad.any():
            found_bad.append(_first_mismatch(plan, chunk, bad, chunk.values, found.reshape(chunk.values.shape)))
            if chunk.unit is None:
                break
    return found_bad


def _type_problem(plan: PlannedTensor, qtype: Q, want: Q) -> str | None:
    if qtype != want and qtype not in _BOUNDS:
        return f"GGUF type {qtype.name}, expected {want.name} (no error bound known for {qtype.name})"
    block = GGML_QUANT_SIZES[qtype][0]
    if plan.shape[-1] % block:
        return f"GGUF type {qtype.name} needs rows of whole {block}-blocks, the row length is {plan.shape[-1]}"
    return None


def read_sources(ckpt: _Checkpoint, plan: PlannedTensor) -> list[_Source]:
    """The plan's sources (per expert: the table's source rows again), checked against the table."""
    specs = itertools.cycle(plan.spec.sources)
    return [ckpt.get(name, shape, spec.dtypes) for (name, shape), spec in zip(plan.sources, specs)]


def _diff_one(ckpt: _Checkpoint, gguf: _GGUF, cfg: K3Config, plan: PlannedTensor,
              intended: Mapping[str, str]) -> TensorDiff:
    t = gguf.tensors[plan.name]
    qtype = Q(t.tensor_type)
    sources = read_sources(ckpt, plan)
    want = exact_type(plan, sources)

    def result(status: str, detail: str, mismatches: Iterable[Mismatch] = ()) -> TensorDiff:
        return TensorDiff(plan.name, plan.layer, status, detail, qtype.name, want.name, tuple(mismatches))

    found_shape = tuple(int(n) for n in reversed(t.shape))
    if found_shape != plan.shape:
        return result(SHAPE, f"GGUF shape {list(found_shape)} (numpy order), expected {list(plan.shape)}")
    problem = _type_problem(plan, qtype, want)
    if plan.name in intended and intended[plan.name] != qtype.name:
        problem = f"GGUF type {qtype.name}, the conversion intended {intended[plan.name]}"
    if problem:
        return result(TYPE, problem)
    exact = qtype == want
    mismatches = _compare(gguf, plan, _releasing(REFERENCES[plan.transform](cfg, plan, sources), ckpt, gguf),
                          qtype, exact)
    if mismatches:
        shown = "; ".join(m.describe() for m in mismatches[:_MAX_UNITS_SHOWN])
        more = f"; and {len(mismatches) - _MAX_UNITS_SHOWN} more" if len(mismatches) > _MAX_UNITS_SHOWN else ""
        bound = "" if exact else f" (beyond the {qtype.name} bound; expected type {want.name})"
        return result(MISMATCH, shown + more + bound, mismatches)
    return result(EXACT, "") if exact else result(WITHIN_BOUND, f"within {qtype.name} bound (source type {want.name})")


# ---- the diff over a layer selection --------------------------------------------------------

_LAYER_PREFIX = next(s.gguf for s in TABLE if s.group == "layer").split("{l}")[0]  # "blk."


def gguf_layer(name: str) -> int | None:
    """The layer a GGUF tensor name belongs to, None for a global (prefix taken from the table)."""
    if not name.startswith(_LAYER_PREFIX):
        return None
    head = name[len(_LAYER_PREFIX):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def select_layers(cfg: K3Config, layers: Iterable[int] | None) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(cfg.num_layers))
    chosen = tuple(sorted(set(int(l) for l in layers)))
    outside = [l for l in chosen if not 0 <= l < cfg.num_layers]
    if outside:
        raise KimiError(f"layers {outside} are outside 0..{cfg.num_layers - 1} "
                        f"(0-based; the model has {cfg.num_layers})")
    return chosen


def _in_scope(layer: int | None, chosen: set[int], include_globals: bool) -> bool:
    return (layer is None and include_globals) or layer in chosen


def iter_tensor_diffs(model_dir: Path | str, gguf_path: Path | str, layers: Iterable[int] | None = None,
                      include_globals: bool = True, intended_types: Mapping[str, str] | None = None,
                      ) -> Iterator[TensorDiff]:
    """Per tensor verdicts in file order, then the GGUF's unexpected tensors (stop early at will).

    `intended_types` (GGUF name -> GGML type name, e.g. from the quantization rules) makes any other
    type a `type` difference; without it every type with a known error bound is compared.
    """
    model_dir, gguf_path = Path(model_dir), Path(gguf_path)
    cfg = load_config(model_dir)
    chosen = set(select_layers(cfg, layers))
    ckpt, gguf = _Checkpoint(model_dir), _GGUF(gguf_path)
    expected: set[str] = set()
    for plan in plan_tensors(cfg):
        if not _in_scope(plan.layer, chosen, include_globals):
            continue
        if plan.spec.optional and not ckpt.has(plan.sources[0][0]):
            continue  # not in this checkpoint, so not in its plan: a GGUF copy is unexpected
        expected.add(plan.name)
        if plan.name not in gguf.tensors:
            yield TensorDiff(plan.name, plan.layer, MISSING, "in the plan, not in the GGUF")
        else:
            yield _diff_one(ckpt, gguf, cfg, plan, intended_types or {})
    for name, t in gguf.tensors.items():
        layer = gguf_layer(name)
        in_scope = layer in chosen or (layer is None and include_globals) or (layer or 0) >= cfg.num_layers
        if in_scope and name not in expected:
            yield TensorDiff(name, layer, UNEXPECTED, "in the GGUF, not in the plan for this checkpoint",
                             Q(t.tensor_type).name)


def diff_gguf(model_dir: Path | str, gguf_path: Path | str, layers: Iterable[int] | None = None,
              include_globals: bool = True, intended_types: Mapping[str, str] | None = None) -> DiffReport:
    """Compare every GGUF tensor of `layers` (None: all) and, if asked, the globals with the checkpoint."""
    cfg = load_config(model_dir)
    report = DiffReport(str(model_dir), str(gguf_path), select_layers(cfg, layers))
    report.tensors.extend(iter_tensor_diffs(model_dir, gguf_path, report.layers, include_globals, intended_types))
    return report


# ---- command line ---------------------------------------------------------------------------

def _parse_layers(text: str) -> list[int] | None:
    if text.strip().lower() == "all":
        return None
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise KimiError(f"--layers must be 'all' or comma-separated 0-based layer numbers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="kimi-k3-diff",
        description="Compare a kimi-k3 GGUF tensor by tensor with the HF checkpoint it was converted from. "
                    "Exit 0: everything matches; 1: a difference; 2: bad input.")
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="HF checkpoint directory (config.json + safetensors shards)")
    parser.add_argument("gguf", metavar="GGUF", help="the converted GGUF file")
    parser.add_argument("--layers", default="all", help="'all' (default) or 0-based layers, e.g. 0,3,12")
    parser.add_argument("--no-globals", action="store_true",
                        help="leave out token_embd, output and the other globals")
    parser.add_argument("--json", action="store_true", help="one JSON report instead of one line per tensor")
    return parser


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    cfg = load_config(args.model_dir)
    report = DiffReport(args.model_dir, args.gguf, select_layers(cfg, _parse_layers(args.layers)))
    in_scope = [p for p in plan_tensors(cfg) if _in_scope(p.layer, set(report.layers), not args.no_globals)]
    with task_bar("comparing", len(in_scope), enabled=sys.stderr.isatty()) as bar:
        for diff in iter_tensor_diffs(args.model_dir, args.gguf, report.layers, not args.no_globals):
            report.tensors.append(diff)
            bar.update()
            if not args.json:
                bar.write(diff.line(), file=sys.stdout)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.summary())
    return 0 if report.ok else DIFFERENCES_EXIT


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: _run(argv))


if __name__ == "__main__":
    sys.exit(main())
