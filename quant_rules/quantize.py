"""Re-encode a stream of tensor bytes from one GGML type to another, whole rows at a time.

The converter's transforms yield a tensor's bytes at its contract type in chunks that need not
end on a row. `reencode` regroups them into batches of whole rows, decodes each batch to f32
(exactly: bf16/f16 widen, MXFP4 expands E2M1 x 2^e) and encodes it with gguf-py's own quantizers
(`gguf.quants.quantize`), so memory stays at one input chunk plus one batch whatever the tensor's
size. Batches are whole rows, and every quantizer here works block by block within a row, so the
bytes equal quantizing the whole tensor at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

from gguf_arch.arch.transforms import SAME_BYTES
from gguf_arch.io.gguf_file import row_nbytes
from gguf_arch.io.safetensors import NUMPY_DTYPES, to_f32

# f32 values decoded at once (4 MiB); gguf-py's MXFP4 quantizer needs 16x that in temporaries.
BATCH_VALUES = 1024 * 1024


# The float GGML types by the safetensors dtype that holds the same bytes.
_FLOAT_DTYPE = {q: dtype for dtype, q in SAME_BYTES.items()}


def decode_rows(t: Q, raw: np.ndarray, row: int) -> np.ndarray:
    """uint8 bytes of whole rows of type `t` -> f32 [rows, row]."""
    if t in _FLOAT_DTYPE:
        dtype = _FLOAT_DTYPE[t]
        return to_f32(dtype, raw.view(NUMPY_DTYPES[dtype])).reshape(-1, row)
    return quants.dequantize(raw.reshape(-1, row_nbytes(t, row)), t).reshape(-1, row)


def encode_rows(values: np.ndarray, t: Q) -> np.ndarray:
    """f32 [rows, row] -> the bytes of type `t`, flat uint8."""
    return np.ascontiguousarray(quants.quantize(values, t)).reshape(-1).view(np.uint8)


@dataclass
class ErrorMeter:
    """Relative error ||w' - w|| / ||w|| of an encoding, accumulated batch by batch."""

    sq_err: float = 0.0
    sq_ref: float = 0.0

    def add(self, ref: np.ndarray, got: np.ndarray) -> None:
        self.sq_err += float(np.sum((got.astype(np.float64) - ref) ** 2))
        self.sq_ref += float(np.sum(ref.astype(np.float64) ** 2))

    @property
    def relative(self) -> float:
        return math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref else math.sqrt(self.sq_err)


def reencode(chunks: Iterable[memoryview | bytes], src: Q, dst: Q, row: int,
             meter: ErrorMeter | None = None) -> Iterator[memoryview]:
    """The bytes of `chunks` (type `src`, rows of `row` values) re-encoded as `dst`."""
    in_row = row_nbytes(src, row)
    batch = max(1, BATCH_VALUES // row) * in_row
    pending = np.empty(0, dtype=np.uint8)
    for chunk in chunks:
        data = np.frombuffer(chunk, dtype=np.uint8)
        pending = np.concatenate([pending, data]) if pending.size else data
        whole = pending.size // in_row * in_row
        for start in range(0, whole, batch):
            yield _encode_batch(pending[start:min(start + batch, whole)], src, dst, row, meter)
        pending = pending[whole:].copy()
    if pending.size:
        raise ValueError(f"{pending.size} trailing bytes do not make a whole row of {row} {src.name} values")


def _encode_batch(raw: np.ndarray, src: Q, dst: Q, row: int, meter: ErrorMeter | None) -> memoryview:
    values = decode_rows(src, raw, row)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported by the non-finite scan
        out = encode_rows(values, dst)
    if meter is not None:
        meter.add(values, decode_rows(dst, out, row))
    return memoryview(out)
