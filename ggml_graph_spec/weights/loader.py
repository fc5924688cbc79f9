"""Open a kimi-k3 GGUF, check it completely, and hand its weights to ggml without copying.

Everything a ggml op could trip over is checked here first, with one-line `GGUFError`s: a ggml
assert aborts the process, so it must never see a file we have not validated. The checks read
the project's tables: the keys through `gguf_arch.arch.keys.config_from_metadata` (the key table
rebuilds the config and checks the file against itself) and the tensors through
`gguf_arch.arch.tensors.plan_tensors`, so this module spells no key or tensor name of its own.

Zero copy: gguf-py memory-maps the file (np.memmap, read-only). The mapping is page aligned and
every tensor offset is a multiple of the file's alignment, so the whole mapping is wrapped as one
CPU backend buffer (`ggml_backend_cpu_buffer_from_ptr`) and each ggml tensor is pointed at its
bytes inside it (`ggml_backend_tensor_alloc`). The weights are read-only: no op may write them.

With `repack=True` the routed experts are copied into ggml's repacked layout instead
(`repack.py`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import ggml
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from gguf_arch.arch.config import K3Config
from gguf_arch.arch.keys import config_from_metadata, upgrade_legacy_keys
from gguf_arch.arch.tensors import OUT_F32, OUT_MXFP4, OUT_SOURCE, PlannedTensor, layer_name, plan_tensors
from gguf_arch.errors import GGUFError
from gguf_arch.io.gguf_file import open_gguf
from gguf_arch.io.split_names import part_paths
from quant_rules.llama_types import LLAMA_QUANTIZE_TYPES
from quant_rules.rules import EXPERT_TYPES, WRITABLE_TYPES

from .repack import Repacked, Source, choose_repack, repack_experts

# Types a "source precision" tensor (matrices, embeddings) may have: every type the converter
# can write (quant_rules: --outtype / --tensor-type) plus those kimi-k3-quantize has
# llama-quantize write (quant_rules/llama_types.py); ggml's CPU matmul and get_rows handle all of
# them. Contract-F32 tensors are all protected (quant_rules/protected.json), so F32 only; the
# routed experts are MXFP4, what --requantize-experts writes, or a kimi-k3-quantize type.
SOURCE_TYPES = frozenset(WRITABLE_TYPES) | frozenset(LLAMA_QUANTIZE_TYPES)
_ALLOWED_TYPES = {OUT_SOURCE: SOURCE_TYPES, OUT_F32: frozenset({Q.F32}),
                  OUT_MXFP4: frozenset({Q.MXFP4, *EXPERT_TYPES, *LLAMA_QUANTIZE_TYPES})}


# ---------------------------------------------------------------------------------------------
# metadata (the key table rebuilds the config: gguf_arch.arch.keys.config_from_metadata)
# ---------------------------------------------------------------------------------------------

def read_metadata(readers: list[GGUFReader]) -> dict[str, Any]:
    """Every key/value of the (first) file, values as Python objects."""
    return {name: _contents(readers[0], name, f) for name, f in readers[0].fields.items()
            if not name.startswith("GGUF.")}


def _contents(reader: GGUFReader, name: str, f) -> Any:
    # gguf-py decodes string values only here, not when it opens the file.
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise GGUFError(f"{reader.data.filename}: metadata {name!r} holds a string that is not valid UTF-8") from None


# ---------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------

def _ne(planned_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(planned_shape))


def check_tensors(cfg: K3Config, found: Mapping[str, Any], where: str) -> list[PlannedTensor]:
    """Every planned tensor present with its type and shape, nothing else; returns the plan."""
    plan = list(plan_tensors(cfg))
    planned = {p.name for p in plan}
    extra = sorted(set(found) - planned)
    if extra:
        raise GGUFError(f"{where}: {len(extra)} tensor(s) not in the kimi-k3 table for this config, "
                        f"first: {extra[0]!r}")
    present = []
    for p in plan:
        t = found.get(p.name)
        if t is None:
            if p.spec.optional:
                continue
            raise GGUFError(f"{where}: missing tensor {p.name!r} (expected ggml ne {list(_ne(p.shape))})")
        ne = tuple(int(d) for d in t.shape)
        ne = ne + (1,) * (len(p.shape) - len(ne))
        if ne[:len(p.shape)] != _ne(p.shape) or any(d != 1 for d in ne[len(p.shape):]):
            raise GGUFError(f"{where}: tensor {p.name!r} has ggml ne {list(ne)}, expected {list(_ne(p.shape))}")
        allowed = _ALLOWED_TYPES[p.spec.out]
        if t.tensor_type not in allowed:
            raise GGUFError(f"{where}: tensor {p.name!r} has type {t.tensor_type.name}, expected "
                            f"{' or '.join(sorted(q.name for q in allowed))}")
        present.append(p)
    return present


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------

# ggml-python 0.0.45 declares ggml_backend_cpu_buffer_from_ptr with the Python NewType
# `ggml_backend_buffer_t` (an int) as restype, so ctypes truncates the returned pointer to a
# C int and the next use of the buffer segfaults. Bind the same C symbol with a pointer restype.
_cpu_buffer_from_ptr = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ggml.lib.ggml_backend_cpu_buffer_from_ptr, ctypes.c_void_p).value)


@dataclass
class _MappedFile:
    """One memory-mapped GGUF file wrapped as a read-only ggml CPU buffer."""

    reader: GGUFReader
    buffer: Any  # ggml_backend_buffer_t

    @classmethod
    def wrap(cls, reader: GGUFReader) -> "_MappedFile":
        mm = reader.data
        base = mm.ctypes.data
        # ggml_backend_cpu_buffer_from_ptr asserts a TENSOR_ALIGNMENT (32) aligned pointer;
        # an mmap base is page aligned, so this only fails on a foreign memmap.
        if base % 32:
            raise GGUFError(f"memory map of {reader.data.filename} is not 32-byte aligned")
        buf = _cpu_buffer_from_ptr(base, mm.nbytes)
        return cls(reader, buf)

    def address(self, data_offset: int) -> int:
        return self.reader.data.ctypes.data + data_offset


@dataclass
class GGUFWeights:
    """A validated kimi-k3 GGUF: the config and a ggml tensor per GGUF tensor, no copies (but
    the repacked experts, with repack=True)."""

    path: Path
    cfg: K3Config
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # GGUF name -> ggml_tensor_p
    _files: list[_MappedFile] = field(repr=False)
    _ctx: Any = field(repr=False)
    _repacked: Repacked | None = field(default=None, repr=False)
    notes: tuple[str, ...] = ()  # what the runner says about how the file was read
    repack_why: str = ""  # why the experts are repacked or not: the option, or the default's reason

    @property
    def reader(self) -> GGUFReader:
        """gguf-py's reader of the (first) file, as opened for the checks: its metadata (the
        tokenizer's, for one) needs no second open."""
        return self._files[0].reader

    @property
    def readers(self) -> list[GGUFReader]:
        """gguf-py's readers of every file of the GGUF (one per split part), in order."""
        return [f.reader for f in self._files]

    @property
    def repacked(self) -> tuple[str, ...]:
        """Names of the tensors held in ggml's repacked layout (empty: every tensor is mapped)."""
        return tuple(self._repacked.tensors) if self._repacked else ()

    @property
    def repacked_bytes(self) -> int:
        return self._repacked.nbytes if self._repacked else 0

    @property
    def mapped_files(self) -> tuple[tuple[str, int, int], ...]:
        """(path, mapping address, size) of each file: where a tensor's data pointer points."""
        return tuple((f.reader.data.filename, f.reader.data.ctypes.data, f.reader.data.nbytes) for f in self._files)

    def layer(self, layer: int) -> "LayerWeights":
        return LayerWeights(self.cfg, layer, self.tensors)

    def close(self) -> None:
        """Free the ggml objects; the tensors must not be used afterwards."""
        for f in self._files:
            ggml.ggml_backend_buffer_free(f.buffer)
        self._files = []
        if self._repacked is not None:
            self._repacked.free()
            self._repacked = None
        if self._ctx is not None:
            ggml.ggml_free(self._ctx)
            self._ctx = None


class LayerWeights:
    """`w(name)` is this layer's ggml tensor of a per-layer name of the tensor table
    (`gguf_arch.arch.tensors`, e.g. `w(ATTN_Q)`)."""

    def __init__(self, cfg: K3Config, layer: int, tensors: Mapping[str, Any]):
        self.cfg = cfg
        self.layer = layer
        self._tensors = tensors

    def __call__(self, name: str) -> Any:
        return self._tensors[layer_name(name, self.layer)]

    def has(self, name: str) -> bool:
        return layer_name(name, self.layer) in self._tensors


def _ggml_tensor(ctx, name: str, ggml_type: int, ne: tuple[int, ...]):
    t = ggml.ggml_new_tensor(ctx, ggml_type, len(ne), (ctypes.c_int64 * len(ne))(*ne))
    ggml.ggml_set_name(t, name.encode())
    return t


def _tensor_bytes_in_file(reader: GGUFReader, t, where: str) -> None:
    end = t.data_offset + t.n_bytes
    if end > reader.data.nbytes or t.data_offset % reader.alignment:
        raise GGUFError(f"{where}: tensor {t.name!r} data [{t.data_offset}, {end}) is outside the file "
                        f"({reader.data.nbytes} bytes) or not {reader.alignment}-byte aligned")


def _source(files: list[_MappedFile], found: Mapping[str, tuple[int, Any]], name: str) -> Source:
    i, t = found[name]
    return Source(name, int(t.tensor_type), tuple(int(d) for d in t.shape), files[i].address(t.data_offset),
                  int(t.n_bytes))


Adjust = Callable[[dict[str, Any], K3Config], tuple[dict[str, Any], K3Config]]


def _repack(files: list[_MappedFile], found: Mapping[str, tuple[int, Any]], present: list, repack: bool | None,
            where: str) -> tuple[Repacked | None, str]:
    """The routed experts repacked or not (None: as choose_repack says), and why."""
    why = "--repack" if repack else ""
    if repack is None:
        repack, why = choose_repack(sum(f.reader.data.nbytes for f in files))
    if not repack:
        return None, why
    sources = [_source(files, found, p.name) for p in present if p.spec.out == OUT_MXFP4]
    return repack_experts(sources, where), why


def load_gguf(path: Path | str, *, repack: bool | None = False, adjust: Adjust | None = None) -> GGUFWeights:
    """Open, validate and map a kimi-k3 GGUF (single file or the first file of a split).

    repack: copy the routed experts into ggml's repacked layout (module docstring); None: when
    the GGUF fits in memory (repack.choose_repack), as the runner's default. adjust:
    (metadata, config) -> (metadata, config), run after every check and before the first ggml
    object, so what it refuses (the runner's --override-kv) never reaches ggml."""
    path = Path(path)
    first = open_gguf(path)
    paths = part_paths(path, first)
    readers = [first] + [open_gguf(p) for p in paths[1:]]
    meta, notes = upgrade_legacy_keys(read_metadata(readers), str(path))
    cfg = config_from_metadata(meta, str(path))
    found: dict[str, tuple[int, Any]] = {}
    for i, (p, r) in enumerate(zip(paths, readers)):
        for t in r.tensors:
            if t.name in found:
                raise GGUFError(f"{p}: tensor {t.name!r} appears twice")
            _tensor_bytes_in_file(r, t, str(p))
            found[t.name] = (i, t)
    present = check_tensors(cfg, {n: t for n, (_, t) in found.items()}, str(path))
    if adjust is not None:
        meta, cfg = adjust(meta, cfg)

    files = [_MappedFile.wrap(r) for r in readers]
    try:
        repacked, why = _repack(files, found, present, repack, str(path))
    except GGUFError:
        for f in files:
            ggml.ggml_backend_buffer_free(f.buffer)
        raise
    mapped = [p for p in present if repacked is None or p.name not in repacked.tensors]
    overhead = ggml.ggml_tensor_overhead() * (len(mapped) + 1)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=overhead, mem_buffer=None, no_alloc=True))
    tensors = {}
    for p in mapped:
        i, t = found[p.name]
        gt = _ggml_tensor(ctx, p.name, int(t.tensor_type), tuple(int(d) for d in t.shape))
        ggml.ggml_backend_tensor_alloc(files[i].buffer, gt, ctypes.c_void_p(files[i].address(t.data_offset)))
        tensors[p.name] = gt
    if repacked is not None:
        tensors.update(repacked.tensors)
    return GGUFWeights(path, cfg, meta, tensors, files, ctx, repacked, notes, why)
