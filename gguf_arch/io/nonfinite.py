"""Non-finite values in a GGML tensor's bytes, found as the bytes stream past the writer.

What the converter writes is checked, not what it read: a NaN or inf copied from a source
tensor, an E8M0 scale byte 0xFF (NaN in the OCP MX format; ggml decodes it as 2^128), a bf16
1e10 that --outtype f16 turns into inf, an A_log whose -exp overflows f32, a block scale of a
quantized type that overflows f16: all of them show in the output bytes. The scan reads only what
decides finiteness (the values of the float types, the scales of the block types: 1/17 of the
MXFP4 bytes), so it costs a fraction of the copy it rides along (bench/convert.py measures it).
Each chunk is scanned slice by slice, so each slice is read from memory once and checked while
it is in the CPU's cache.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

# Block types: the byte offsets of their f16 scales (d, and m for the _1 types) in each block.
_F16_SCALES: dict[Q, tuple[int, ...]] = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q4_1: (0, 2),
                                         Q.Q5_1: (0, 2)}
_E8M0_NAN = 0xFF  # MXFP4: the block's first byte is its E8M0 scale


def _bad_units(qtype: Q, units: np.ndarray) -> np.ndarray:
    """Per unit (an element of a float type, a block of a block type): does it decode non-finite?
    `units` is uint8 [n, unit bytes]."""
    if qtype == Q.F32:
        return ~np.isfinite(units.view("<f4")[:, 0])
    if qtype == Q.F16:
        return ~np.isfinite(units.view("<f2")[:, 0])
    if qtype == Q.BF16:  # exponent all ones: inf or NaN
        return (units.view("<u2")[:, 0] & 0x7F80) == 0x7F80
    if qtype == Q.MXFP4:
        return units[:, 0] == _E8M0_NAN
    bad = np.zeros(len(units), dtype=bool)
    for off in _F16_SCALES[qtype]:
        bad |= ~np.isfinite(np.ascontiguousarray(units[:, off:off + 2]).view("<f2")[:, 0])
    return bad


# Float types as integers: a value is NaN or inf exactly when its exponent bits are all ones.
# Read as signed, a positive one is at least the +inf pattern (every negative value is below
# zero); read as unsigned, a negative one is at least the -inf pattern (every positive value is
# below the sign bit). Two max reductions, read-only: no float arithmetic (no FP exceptions), no
# mask or temporary written.
_FLOAT_BITS: dict[Q, tuple[str, str, int, int]] = {  # signed, unsigned view; +inf, -inf patterns
    Q.F32: ("<i4", "<u4", 0x7F800000, 0xFF800000),
    Q.F16: ("<i2", "<u2", 0x7C00, 0xFC00),
    Q.BF16: ("<i2", "<u2", 0x7F80, 0xFF80),
}
# The quick pass runs over slices of this many bytes, so that the second reduction finds the slice
# in the CPU's cache (chunk-sized temporaries, an earlier form, were fresh pages each time,
# zero-filled by the kernel: 12% of the converter's CPU in perf; 64 KiB slices cost more in numpy
# call overhead than 256 KiB ones).
_SLICE_BYTES = 256 << 10


def _any_bad_float(qtype: Q, data: np.ndarray) -> bool:
    signed, unsigned, pos_inf, neg_inf = _FLOAT_BITS[qtype]
    as_signed, as_unsigned = data.view(signed), data.view(unsigned)
    step = _SLICE_BYTES // as_signed.itemsize
    for i in range(0, as_signed.size, step):
        if int(as_signed[i:i + step].max()) >= pos_inf or int(as_unsigned[i:i + step].max()) >= neg_inf:
            return True
    return False


def _any_bad(qtype: Q, units: np.ndarray) -> bool:
    """A quick first pass for the common case, no bad unit: reductions over cached slices, no
    full-size mask. `units` is uint8 [n, unit bytes], C-contiguous."""
    if qtype in _FLOAT_BITS:
        return units.size > 0 and _any_bad_float(qtype, units.reshape(-1))
    if qtype == Q.MXFP4:  # the scale bytes, a strided view: 1/17 of the bytes
        return units.size > 0 and int(units[:, 0].max()) == _E8M0_NAN
    return bool(_bad_units(qtype, units).any())


def supported(qtype: Q) -> bool:
    return qtype in (Q.F32, Q.F16, Q.BF16, Q.MXFP4) or qtype in _F16_SCALES


class NonFiniteScan:
    """Fed a tensor's bytes in order, in chunks of any size; counts the non-finite units and
    remembers the first one's element index."""

    def __init__(self, qtype: Q) -> None:
        self.qtype = qtype
        self.unit_elems, self.unit_bytes = GGML_QUANT_SIZES[qtype]
        self.units_seen = 0
        self.bad_units = 0
        self.first: int | None = None  # element index of the first non-finite value (its block's first)
        self._carry = np.empty(0, dtype=np.uint8)  # the bytes of a unit split between two chunks

    @property
    def unit(self) -> str:
        return "value" if self.unit_elems == 1 else f"{self.unit_elems}-value block"

    def feed(self, chunk) -> None:
        data = np.frombuffer(chunk, dtype=np.uint8)
        if self._carry.size:
            data = np.concatenate([self._carry, data])
        whole = data.size // self.unit_bytes * self.unit_bytes
        self._carry = data[whole:].copy()
        units = data[:whole].reshape(-1, self.unit_bytes)
        if _any_bad(self.qtype, units):
            bad = _bad_units(self.qtype, units)
            if self.first is None:
                self.first = (self.units_seen + int(np.argmax(bad))) * self.unit_elems
            self.bad_units += int(np.count_nonzero(bad))
        self.units_seen += len(units)
