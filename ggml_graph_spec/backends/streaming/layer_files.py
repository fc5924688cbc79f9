"""Where each layer's weights are in the GGUF files, for a memory budget's executor: a layer's
trunk (every tensor but the routed experts) as runs of adjacent tensors read as one into a slot,
laid out as in the file so that O_DIRECT reads it straight in; and its stacked routed experts."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import ggml
import numpy as np

from gguf_arch.arch.tensors import ROUTED_EXPERTS, gguf_kind, gguf_layer, layer_name
from gguf_arch.io.direct_io import BLOCK, open_direct

from .budget import ExpertSizes
from .experts import ExpertStack, pitches, read_range

_ALIGN = 64  # what a trunk tensor counts for in the plan: above ggml's TENSOR_ALIGNMENT (32)
_GAP = BLOCK  # trunk tensors at most this far apart in a file are one run, read as one (the gap too)
_TRUNK_CHUNK = 8 << 20  # a run's O_DIRECT requests (as kimi-k3-doctor's sequential read)
EXPERT_KINDS = tuple(gguf_kind(layer_name(n, 0)) for n in ROUTED_EXPERTS)  # ffn_gate_exps, ...


def slot_align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Run:
    """Trunk tensors of a layer next to each other in one file, read as one (O_DIRECT where the
    file system allows): their bytes land in the slot at `slot_offset`, congruent to the file
    offset modulo BLOCK, so the blocks around them are read straight in (pread_direct_at)."""

    fd: int
    direct: int | None
    path: str
    file_offset: int
    nbytes: int
    slot_offset: int


@dataclass(frozen=True)
class Piece:
    """One weight tensor of a layer: where its bytes are in a file and in a slot."""

    tensor: object  # ggml_tensor_p
    fd: int
    path: str
    file_offset: int
    nbytes: int
    slot_offset: int


class LayerFiles:
    """The layers' tensors located in the GGUF files (open read-only for pread): each layer's
    trunk pieces, and its stacked routed experts."""

    def __init__(self, weights):
        self._paths = [str(path) for path, _, _ in weights.mapped_files]
        self._fds = [os.open(path, os.O_RDONLY) for path in self._paths]
        self._direct = [open_direct(fd, path) for fd, path in zip(self._fds, self._paths)]
        direct = dict(zip(self._fds, self._direct))
        maps = [(base, size) for _, base, size in weights.mapped_files]
        self.layers: dict[int, list[Piece]] = {}
        self.runs: dict[int, list[Run]] = {}
        self.slot_sizes: dict[int, int] = {}  # a layer's trunk in a slot, laid out as in the file (_place)
        self.experts: dict[int, list[ExpertStack]] = {}
        self.outside = 0  # bytes of the tensors no layer owns (embedding, head)
        for name, t in weights.tensors.items():
            layer, kind = gguf_layer(name), gguf_kind(name)
            if layer is None:
                self.outside += ggml.ggml_nbytes(t)
                continue
            p = self._locate(t, maps)
            if kind in EXPERT_KINDS:
                stride = t.contents.nb[2]
                self.experts.setdefault(layer, []).append(
                    (EXPERT_KINDS.index(kind), ExpertStack(t, p.fd, p.path, p.file_offset, stride, t.contents.ne[2],
                                                           direct[p.fd])))
            else:
                self.layers.setdefault(layer, []).append(p)
        self.experts = {l: [s for _, s in sorted(v, key=lambda x: x[0])] for l, v in self.experts.items()}
        for layer, pieces in self.layers.items():
            pieces.sort(key=lambda p: (p.fd, p.file_offset))  # sequential reads
            self.layers[layer], self.runs[layer], self.slot_sizes[layer] = place_pieces(pieces, direct)

    def _locate(self, t, maps) -> Piece:
        addr = t.contents.data
        for fd, path, (base, size) in zip(self._fds, self._paths, maps):
            if base <= addr < base + size:
                return Piece(t, fd, path, addr - base, ggml.ggml_nbytes(t), 0)
        raise ValueError(f"tensor {ggml.ggml_get_name(t)!r} is not in a mapped GGUF file")

    @property
    def n_layers(self) -> int:
        return max([*self.layers, *self.experts]) + 1

    def layer_bytes(self) -> list[int]:
        """Bytes of each layer's trunk (every tensor but the routed experts), as a dry-run listing
        gives them too (backends/streaming/listing.py): each tensor's, aligned."""
        return [sum(slot_align(p.nbytes) for p in self.layers.get(l, ())) for l in range(self.n_layers)]

    def slot_excess(self) -> int:
        """The most a layer's trunk takes more in a slot (laid out as in the file) than layer_bytes."""
        sizes = self.layer_bytes()
        return max([0, *(n - sizes[l] for l, n in self.slot_sizes.items())])

    def expert_sizes(self, used: int, pitched: bool) -> ExpertSizes | None:
        """The experts for the plan (the bytes of an entry of a cache `pitched` or not); None when
        the MoE layers' experts differ in shape (then the cache, one shape per kind, cannot serve
        them all and no expert is streamed alone)."""
        shapes = {tuple(s.shape for s in v) for v in self.experts.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != len(EXPERT_KINDS):
            return None
        per_layer = tuple(self.experts[l][0].count if l in self.experts else 0 for l in range(self.n_layers))
        return ExpertSizes(per_layer, sum(pitches([s[3] for s in next(iter(shapes))], pitched)), used)

    def expert_bytes(self) -> int:
        return sum(s.stride * s.count for v in self.experts.values() for s in v)

    def close(self) -> None:
        for fd in [*self._fds, *self._direct]:
            if fd is not None:
                os.close(fd)
        self._fds, self._direct = [], []


def place_pieces(pieces: list[Piece], direct: dict[int, int | None]) -> tuple[list[Piece], list[Run], int]:
    """The slot's layout of a layer's trunk (pieces sorted by file and offset): runs of pieces at
    most _GAP apart keep their file layout (the gap is read with them), each run from a block
    boundary of the slot plus its file offset's place in a block; and the bytes the slot needs."""
    out, runs, end = [], [], 0
    for p in pieces:
        r = runs[-1] if runs else None
        if r is None or r.fd != p.fd or not 0 <= p.file_offset - (r.file_offset + r.nbytes) <= _GAP:
            r = Run(p.fd, direct.get(p.fd), p.path, p.file_offset, 0, end + p.file_offset % BLOCK)
            runs.append(r)
        runs[-1] = r = replace(r, nbytes=p.file_offset + p.nbytes - r.file_offset)
        out.append(replace(p, slot_offset=r.slot_offset + p.file_offset - r.file_offset))
        end = -(-(r.slot_offset + r.nbytes) // BLOCK) * BLOCK
    return out, runs, end


def read_layer(runs: list[Run], slot: np.ndarray) -> int:
    """A layer's trunk into `slot` (block-aligned), around the page cache where the file system
    allows (else pread, the pages dropped after); the bytes read."""
    return sum(read_range(r.fd, r.direct, r.path, slot.ctypes.data + r.slot_offset, r.nbytes, r.file_offset,
                          room=True, chunk=_TRUNK_CHUNK) for r in runs)
