"""Non-finite values never pass silently: each output tensor's bytes are scanned as they stream to
the writer (`io.nonfinite`, no extra read). The first NaN or inf ends the conversion with one line
naming the tensor, its source and the first bad element (exit 2, nothing left under OUT); with
--allow-non-finite the tensor is written as it is, with one warning line per tensor on stderr."""
from __future__ import annotations

import math
import sys
from typing import Iterable, Iterator

import numpy as np

from ..errors import KimiError
from ..io.gguf_writer import OutputTensor
from ..io.nonfinite import NonFiniteScan, supported
from ..io.pipeline import SerialWorker

# Chunks handed to the scanning thread and not yet scanned (bounded, like the writer's queue).
SCAN_AHEAD = 2


class NonFiniteError(KimiError):
    """A tensor the conversion would write holds NaN or inf."""


def _where(t: OutputTensor, source: str, scan: NonFiniteScan) -> str:
    coords = [int(i) for i in np.unravel_index(scan.first, t.shape)] if math.prod(t.shape) else []
    return (f"{t.name} (from {source}): element {scan.first} {coords} of the {t.ggml_type.name} output "
            f"is not finite (NaN or inf{', a non-finite block scale' if scan.unit_elems > 1 else ''})")


def _refuse(t: OutputTensor, source: str, scan: NonFiniteScan, allow: bool) -> None:
    if scan.first is not None and not allow:
        raise NonFiniteError(f"{_where(t, source, scan)}; fix the checkpoint, or pass --allow-non-finite "
                             "to write it anyway")


def checked_chunks(t: OutputTensor, source: str, chunks: Iterable, allow: bool, threads: int = 1) -> Iterator:
    """`chunks` passed through once scanned; NonFiniteError at the first bad one unless `allow`.

    With `threads` above 1 the scan runs on a thread of its own (numpy releases the GIL), in chunk
    order, at most SCAN_AHEAD chunks behind: a bad chunk may already be on its way to the writer's
    `.partial` when the error is raised, which removes that file; OUT is never written."""
    if not supported(t.ggml_type):
        raise KimiError(f"{t.name}: no non-finite check for GGML type {t.ggml_type.name}")
    scan = NonFiniteScan(t.ggml_type)
    with SerialWorker(SCAN_AHEAD if threads > 1 else 0) as scanner:
        for chunk in chunks:
            scanner.submit(scan.feed, chunk)
            _refuse(t, source, scan, allow)
            yield chunk
        scanner.drain()
    _refuse(t, source, scan, allow)
    if scan.first is not None:
        print(f"warning: {_where(t, source, scan)}; {scan.bad_units} non-finite {scan.unit}(s) written as they "
              "are (--allow-non-finite)", file=sys.stderr)
