"""The routed experts in ggml's repacked layout (`load_gguf(..., repack=...)`).

ggml's CPU backend has an extra buffer type, CPU_REPACK, that stores MXFP4 in the interleaved
8x8 layout its AVX2 gemm/gemv kernels read (4x4 on NEON); llama.cpp puts its weights there by
default (`--no-repack` turns it off). Setting a tensor in that buffer repacks it, so the copy
costs anonymous memory the size of the experts (the bulk of the model) and one pass over them
at load time. ggml decides which tensors it can repack on this CPU; the others stay mapped.

The runner's default follows llama.cpp's where it can (`resolve_repack`, `choose_repack`): the
fast path on this host's CPU repacks when the whole GGUF fits in the memory this process may use;
a model bigger than that stays mapped (anonymous copies cannot be paged back to the file), as do
the exact path, --rpc and --mem-budget, which read the experts from the file.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from dataclasses import dataclass
from typing import Any

import ggml

from gguf_arch.io.console import human_size
from gguf_arch.errors import GGUFError

from .host import MODEL_SHARE, usable_memory

_last_log_level = ggml.GGML_LOG_LEVEL_INFO


@ggml.ggml_log_callback
def _ggml_log(level: int, text: bytes, _user_data) -> None:
    """ggml's default logger prints every level to stderr; like llama.cpp's, ours drops DEBUG
    (one line per repacked tensor, say) and the continuation lines that follow it."""
    global _last_log_level
    if level != ggml.GGML_LOG_LEVEL_CONT:
        _last_log_level = level
    if _last_log_level != ggml.GGML_LOG_LEVEL_DEBUG:
        sys.stderr.write(text.decode(errors="replace"))


ggml.ggml_log_set(_ggml_log, None)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@dataclass(frozen=True)
class Source:
    """A tensor's bytes in a mapped GGUF file."""

    name: str
    ggml_type: int
    ne: tuple[int, ...]
    address: int
    nbytes: int


@dataclass
class Repacked:
    """Tensors copied into a CPU_REPACK buffer: their context and that buffer."""

    tensors: dict[str, Any]  # GGUF name -> ggml_tensor_p
    nbytes: int
    ctx: Any
    buffer: Any

    def free(self) -> None:
        ggml.ggml_backend_buffer_free(self.buffer)
        ggml.ggml_free(self.ctx)


def _release_pages(address: int, nbytes: int) -> None:
    """Drop this process's resident pages of a read-only file mapping (they refault from the
    file if touched again): the repacked copy replaces them, so they need not count twice."""
    start = address - address % mmap.PAGESIZE
    _libc.madvise(start, address + nbytes - start, mmap.MADV_DONTNEED)


def cpu_repack_buffer_type() -> int | None:
    """ggml's CPU_REPACK buffer type, or None where this ggml build has none."""
    dev = ggml.ggml_backend_dev_by_type(ggml.GGML_BACKEND_DEVICE_TYPE_CPU)
    fn = ggml.ggml_backend_reg_get_proc_address(ggml.ggml_backend_dev_backend_reg(dev),
                                                b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    i = 0
    while bufts[i]:
        if ggml.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    return None


def _alloc_in(buft: int, sources: list[Source], where: str) -> tuple[Any, Any, dict[str, Any]]:
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * (len(sources) + 1),
                                               mem_buffer=None, no_alloc=True))
    tensors = {}
    for s in sources:
        t = tensors[s.name] = ggml.ggml_new_tensor(ctx, s.ggml_type, len(s.ne), (ctypes.c_int64 * len(s.ne))(*s.ne))
        ggml.ggml_set_name(t, s.name.encode())
    buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    if not buffer:
        ggml.ggml_free(ctx)
        need = sum(s.nbytes for s in sources)
        raise GGUFError(f"{where}: cannot allocate {human_size(need)} for the repacked experts; "
                        "load without repack (the experts are then read from the mapped file)")
    return ctx, buffer, tensors


def resolve_repack(repack: bool | None, *, exact: bool, rpc: bool, mem_budget: bool) -> bool | None:
    """The runner's repack option (None: the default) as load_gguf takes it: False where the
    experts are read from the file (exact path, --rpc, --mem-budget), None there to choose."""
    if repack is None and (exact or rpc or mem_budget):
        return False
    return repack


def choose_repack(gguf_bytes: int) -> tuple[bool, str]:
    """The default's choice for a GGUF of this size, and why (for the print_info line): it must fit
    in MODEL_SHARE of the usable memory (llama.cpp repacks whatever the size)."""
    usable = usable_memory()
    if gguf_bytes <= MODEL_SHARE * usable:
        return True, f"default: the {human_size(gguf_bytes)} GGUF fits in {human_size(usable)} usable; -nr keeps them mapped"
    return False, (f"default: the {human_size(gguf_bytes)} GGUF is more than {MODEL_SHARE:.0%} of the "
                   f"{human_size(usable)} usable; --repack forces it")


def repack_experts(sources: list[Source], where: str) -> Repacked | None:
    """Copy the tensors of `sources` ggml can repack on this CPU into a CPU_REPACK buffer
    (None: none of them, or no such buffer type in this ggml).

    Only tensors that are nothing but the weight of a mul_mat_id or mul_mat with F32 activations
    (the routed experts on the fast path) may be given: any other op would read the repacked
    bytes as if they were plain ones. Which of them ggml can repack is its decision (type, row
    count, CPU features): its buffer marks such a tensor with layout traits (`extra`) when the
    tensor is allocated. Setting one without them would crash, so the unmarked ones are dropped
    and the rest allocated again.
    """
    buft = cpu_repack_buffer_type()
    if buft is None or not sources:
        return None
    ctx, buffer, tensors = _alloc_in(buft, sources, where)
    keep = [s for s in sources if tensors[s.name].contents.extra]
    if len(keep) < len(sources):
        ggml.ggml_backend_buffer_free(buffer)
        ggml.ggml_free(ctx)
        if not keep:
            return None
        ctx, buffer, tensors = _alloc_in(buft, keep, where)
    for s in keep:
        ggml.ggml_backend_tensor_set(tensors[s.name], ctypes.c_void_p(s.address), 0, s.nbytes)
        _release_pages(s.address, s.nbytes)
    return Repacked(tensors, sum(s.nbytes for s in keep), ctx, buffer)
