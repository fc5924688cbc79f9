"""Open a Kimi K3 mmproj, check it completely, and put its weights on ggml's CPU backend.

The keys go through the mmproj key table (`gguf_arch.arch.mmproj.vision_config_from_metadata`:
a text GGUF, another model's mmproj or an inconsistent key is refused there), the tensors through
the mmproj tensor table: every planned tensor present with its shape and an allowed type, nothing
else, every byte inside the file. Only then does ggml see anything.

The weights are copied into one backend buffer: on the exact path every tensor widened to F32
(gguf-py's dequantizers; BF16 -> F32 is exact), so every matmul runs in F32 as the reference
does; on the fast path as stored (ggml then multiplies BF16 weights against BF16-rounded
activations). The learnt position table also stays on the host, in F32, for the per-grid resize
(`positions.py`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ggml
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from gguf_arch.arch.mmproj import V_POS_EMBD, plan_vision_tensors, vision_config_from_metadata
from gguf_arch.arch.tensors import OUT_F32, PlannedTensor
from gguf_arch.arch.vision import VisionConfig
from gguf_arch.errors import GGUFError
from gguf_arch.io.gguf_file import open_gguf
from gguf_arch.io.split_names import part_paths
from quant_rules.rules import WRITABLE_TYPES

from ..weights.loader import read_metadata

# ggml-python 0.0.45 declares ggml_backend_cpu_buffer_type's restype as a Python NewType (an int),
# so ctypes truncates the pointer; the same C symbol bound with a pointer restype.
_cpu_buffer_type = ctypes.CFUNCTYPE(ctypes.c_void_p)(
    ctypes.cast(ggml.lib.ggml_backend_cpu_buffer_type, ctypes.c_void_p).value)

# What a matrix may be stored as: every type the converter writes (--mmproj-tensor-type); the
# norm gains are F32 (protected).
MATRIX_TYPES = frozenset(WRITABLE_TYPES)


@dataclass
class VisionWeights:
    """A validated mmproj: its config, one ggml tensor per GGUF tensor, the position table on the host."""

    path: Path
    cfg: VisionConfig
    exact: bool  # every weight F32
    tensors: dict[str, Any]  # GGUF name -> ggml_tensor_p
    pos_table: np.ndarray  # float32 [H0, W0, C]
    _ctx: Any = field(repr=False)
    _buffer: Any = field(repr=False)

    def close(self) -> None:
        """Free the ggml objects; the tensors must not be used afterwards."""
        if self._buffer is not None:
            ggml.ggml_backend_buffer_free(self._buffer)
            ggml.ggml_free(self._ctx)
            self._buffer = self._ctx = None

    def __enter__(self) -> "VisionWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _found_tensors(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, GGUF name -> gguf-py tensor) over every part of a split, bytes checked in-file."""
    first = open_gguf(path)
    readers = [first] + [open_gguf(p) for p in part_paths(path, first)[1:]]
    found: dict[str, Any] = {}
    for r in readers:
        for t in r.tensors:
            if t.name in found:
                raise GGUFError(f"{path}: tensor {t.name!r} appears twice")
            if t.data_offset + t.n_bytes > r.data.nbytes:
                raise GGUFError(f"{path}: tensor {t.name!r} data runs past the end of {r.data.filename}")
            found[t.name] = t
    return read_metadata(readers), found


def check_tensors(vcfg: VisionConfig, found: dict[str, Any], where: str) -> list[PlannedTensor]:
    """Every planned tensor present with its shape and an allowed type, nothing else."""
    plan = list(plan_vision_tensors(vcfg))
    extra = sorted(set(found) - {p.name for p in plan})
    if extra:
        raise GGUFError(f"{where}: {len(extra)} tensor(s) not in the kimik3 mmproj table, first: {extra[0]!r}")
    for p in plan:
        t = found.get(p.name)
        want = list(reversed(p.shape))
        if t is None:
            raise GGUFError(f"{where}: missing tensor {p.name!r} (expected ggml ne {want})")
        ne = [int(d) for d in t.shape]
        if ne + [1] * (len(want) - len(ne)) != want:
            raise GGUFError(f"{where}: tensor {p.name!r} has ggml ne {ne}, expected {want}")
        allowed = frozenset({Q.F32}) if p.spec.out == OUT_F32 else MATRIX_TYPES
        if t.tensor_type not in allowed:
            raise GGUFError(f"{where}: tensor {p.name!r} has type {t.tensor_type.name}, expected "
                            f"{' or '.join(sorted(q.name for q in allowed))}")
    return plan


def _f32(t) -> np.ndarray:
    return np.ascontiguousarray(dequantize(np.asarray(t.data), Q(t.tensor_type)), dtype=np.float32)


def _upload(plan: list[PlannedTensor], found: dict[str, Any], exact: bool, where: str) -> tuple[Any, Any, dict]:
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * (len(plan) + 1),
                                               mem_buffer=None, no_alloc=True))
    tensors = {}
    for p in plan:
        t = found[p.name]
        kind = ggml.GGML_TYPE_F32 if exact else int(t.tensor_type)
        ne = [int(d) for d in t.shape]
        g = tensors[p.name] = ggml.ggml_new_tensor(ctx, kind, len(ne), (ctypes.c_int64 * len(ne))(*ne))
        ggml.ggml_set_name(g, p.name.encode())
    buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, _cpu_buffer_type())
    if not buffer:
        ggml.ggml_free(ctx)
        raise GGUFError(f"{where}: cannot allocate memory for the vision weights")
    for p in plan:  # one tensor's F32 copy on the host at a time
        data = _f32(found[p.name]) if exact else np.ascontiguousarray(found[p.name].data)
        ggml.ggml_backend_tensor_set(tensors[p.name], data.ctypes.data_as(ctypes.c_void_p), 0, data.nbytes)
    return ctx, buffer, tensors


def check_pairing(vcfg: VisionConfig, where: str, text_hidden_size: int, media_pad_id: int | None) -> None:
    """GGUFError unless the mmproj fits the text model: its rows as wide as the model's embeddings,
    its placeholder the model's `<|media_pad|>` (None: the model's vocabulary has none)."""
    if vcfg.text_hidden_size != text_hidden_size:
        raise GGUFError(f"{where}: the mmproj's rows are {vcfg.text_hidden_size} wide (clip.vision.projection_dim), "
                        f"the text model's embeddings {text_hidden_size}: an mmproj of another model")
    if media_pad_id != vcfg.media_placeholder_id:
        raise GGUFError(f"{where}: the mmproj's placeholder token is {vcfg.media_placeholder_id}, the text model's "
                        f"<|media_pad|> is {media_pad_id}: an mmproj of another model")


@dataclass(frozen=True)
class MmprojFile:
    """An mmproj whose keys and tensors were checked: nothing of it has reached ggml yet."""

    path: Path
    cfg: VisionConfig
    plan: list[PlannedTensor] = field(repr=False)
    found: dict[str, Any] = field(repr=False)  # GGUF name -> gguf-py tensor


def open_mmproj(path: Path | str) -> MmprojFile:
    """Open and validate a Kimi K3 mmproj (one file or the first part of a split), without ggml:
    what a runner checks before it loads anything."""
    path = Path(path)
    meta, found = _found_tensors(path)
    vcfg = vision_config_from_metadata(meta, str(path))
    return MmprojFile(path, vcfg, check_tensors(vcfg, found, str(path)), found)


def load_mmproj(source: MmprojFile | Path | str, *, exact: bool = True) -> VisionWeights:
    """Load a Kimi K3 mmproj (a path, or the file open_mmproj checked) onto ggml's CPU backend."""
    mm = source if isinstance(source, MmprojFile) else open_mmproj(source)
    vcfg = mm.cfg
    table = _f32(mm.found[V_POS_EMBD]).reshape(vcfg.pos_emb_height, vcfg.pos_emb_width, vcfg.hidden_size)
    ctx, buffer, tensors = _upload(mm.plan, mm.found, exact, str(mm.path))
    return VisionWeights(mm.path, vcfg, exact, tensors, table, ctx, buffer)
