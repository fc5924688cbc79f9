"""Non-finite values never pass silently: each output tensor's bytes are scanned as they stream to
the file (`io.nonfinite`, on the writer's thread, no extra read). The first NaN or inf ends the conversion with one line
naming the tensor, its source and the first bad element (exit 2, nothing left under OUT); with
--allow-non-finite the tensor is written as it is, with one warning line per tensor on stderr."""
from __future__ import annotations

import math
import sys

import numpy as np

from ..errors import KimiError
from ..io.gguf_writer import OutputTensor
from ..io.nonfinite import NonFiniteScan, supported


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


class NonFiniteCheck:
    """A writer's sink (`gguf_writer.Sink`): each tensor's bytes scanned on the writer's thread, on
    slices in the CPU's cache; NonFiniteError at the first bad one unless `allow`. The bad bytes
    may already be in the writer's `.partial` when it is raised, which removes that file; OUT is
    never written. `sources`: each output tensor's (first) source tensor, for the message."""

    def __init__(self, sources: dict[str, str], allow: bool) -> None:
        self._sources, self._allow = sources, allow
        self._t: OutputTensor | None = None
        self._scan: NonFiniteScan | None = None

    def begin(self, t: OutputTensor) -> None:
        if not supported(t.ggml_type):
            raise KimiError(f"{t.name}: no non-finite check for GGML type {t.ggml_type.name}")
        self._t, self._scan = t, NonFiniteScan(t.ggml_type)

    def update(self, data) -> None:
        self._scan.feed(data)
        _refuse(self._t, self._sources[self._t.name], self._scan, self._allow)

    def end(self, t: OutputTensor) -> None:
        scan, source = self._scan, self._sources[t.name]
        _refuse(t, source, scan, self._allow)
        if scan.first is not None:
            print(f"warning: {_where(t, source, scan)}; {scan.bad_units} non-finite {scan.unit}(s) written as they "
                  "are (--allow-non-finite)", file=sys.stderr)
