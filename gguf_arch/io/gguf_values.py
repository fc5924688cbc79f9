"""What each GGUF value type can hold, checked once for every value a tool writes or overrides.

A number that JSON or a command line holds but the key's type cannot (2**32 in a uint32, 1e300 or
NaN in a float32, -5 in a uint32) would end in a `struct.error` traceback while the header is
packed, be silently rounded (1e-50 -> 0.0 in float32) or reach ggml as a wrapped integer. The
config reader, the GGUF writer and the runner's --override-kv all ask `problem` instead.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from gguf import GGUFValueType as T

_INT_RANGES: dict[T, tuple[int, int]] = {
    T.UINT8: (0, 2**8 - 1), T.INT8: (-2**7, 2**7 - 1),
    T.UINT16: (0, 2**16 - 1), T.INT16: (-2**15, 2**15 - 1),
    T.UINT32: (0, 2**32 - 1), T.INT32: (-2**31, 2**31 - 1),
    T.UINT64: (0, 2**64 - 1), T.INT64: (-2**63, 2**63 - 1),
}
F32_MAX = float(np.finfo(np.float32).max)


def describe(vtype: T) -> str:
    """What a value of this type is, for messages: 'an integer in 0..4294967295 (uint32)'."""
    if vtype in _INT_RANGES:
        lo, hi = _INT_RANGES[vtype]
        return f"an integer in {lo}..{hi} ({vtype.name.lower()})"
    if vtype == T.FLOAT32:
        return f"a finite number float32 holds (|x| <= {F32_MAX:.4g}, not so small it rounds to 0)"
    return {T.FLOAT64: "a finite number", T.BOOL: "true or false", T.STRING: "a string"}.get(vtype, "an array")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _fits_scalar(vtype: T, value: Any) -> bool:
    if vtype in _INT_RANGES:
        lo, hi = _INT_RANGES[vtype]
        return _is_int(value) and lo <= value <= hi
    if vtype in (T.FLOAT32, T.FLOAT64):
        if not (_is_int(value) or isinstance(value, (float, np.floating))) or isinstance(value, bool):
            return False
        x = float(value)
        if vtype == T.FLOAT64:
            return math.isfinite(x)
        return math.isfinite(x) and abs(x) <= F32_MAX and (x == 0 or np.float32(x) != 0)
    if vtype == T.BOOL:
        return isinstance(value, (bool, np.bool_))
    return isinstance(value, str)


def problem(vtype: T, value: Any, sub_type: T | None = None) -> str | None:
    """Why `value` cannot be written as a GGUF value of `vtype` (arrays: of `sub_type`), or None."""
    if vtype == T.ARRAY:
        if not isinstance(value, (list, tuple)):
            return f"must be an array, got {value!r}"
        bad = next((i for i, v in enumerate(value) if sub_type is None or not _fits_scalar(sub_type, v)), None)
        if bad is not None:
            return f"element [{bad}] is {value[bad]!r}, expected {describe(sub_type)}"
        return None
    if not _fits_scalar(vtype, value):
        return f"is {value!r}, expected {describe(vtype)}"
    return None
