"""Whether a context fits in this host's memory, decided at load.

What a context needs beyond the weights: its caches (graph/cache.py: `cache_sizes`, exact from
the model's sizes) and the compute buffer of its largest graph, which ggml-alloc measures on the
worst micro-batches the context can see (`worst_ubatches`: n_ubatch tokens of one sequence with
the whole context before them, and one token of each of n_seq sequences at full context) without
allocating it. The load compares the sum with the memory the kernel says is available and
refuses a context that does not fit with the figures (an OptionError naming -c), then reserves
that buffer, so that no later call grows it: a long context fails at load, never with an
allocation failure (or the kernel's OOM killer) in the middle of a run. The caches are checked
first, before they are allocated, so that a context far too large never reaches malloc.
"""
from __future__ import annotations

import os
from pathlib import Path

from gguf_arch.io.console import human_size

from ..graph.cache import CacheSizes
from ..graph.ubatch import UBatch
from .options import LoadOptions, OptionError

MEMINFO = Path("/proc/meminfo")


def free_bytes(meminfo: Path = MEMINFO) -> int | None:
    """Memory a new allocation can use without swapping: Linux's MemAvailable (which counts the
    page cache the kernel may drop, the mapped weights' pages among them: those are read again
    from the file when needed); elsewhere the free physical pages; None when neither is known."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def worst_ubatches(options: LoadOptions) -> list[UBatch]:
    """The micro-batches whose graphs need the largest compute buffer: the longest one (n_ubatch
    tokens of one sequence, the rest of its context already cached) and, with several sequences,
    one token of each at full context (every run's attention over a whole cache)."""
    n_ctx, T = options.n_ctx_seq, min(options.n_ubatch_eff, options.n_ctx_seq)
    out = [UBatch([(0, n_ctx - T, T)])]
    if options.n_seq > 1:
        out.append(UBatch([(s, n_ctx - 1, 1) for s in range(min(options.n_seq, options.n_ubatch_eff))]))
    return out


def _describe(options: LoadOptions, caches: CacheSizes, compute: int | None) -> str:
    parts = [f"latent {human_size(caches.latent)}", f"indexer keys {human_size(caches.indexer)}",
             f"KDA states {human_size(caches.kda_conv + caches.kda_state)}"]
    need = f"the caches need {human_size(caches.total)} ({', '.join(parts)})"
    if compute is not None:
        need += (f" and the compute buffer {human_size(compute)} (micro-batches of {options.n_ubatch_eff} tokens "
                 f"at the full context), {human_size(caches.total + compute)} in all")
    return need


def check_fits(options: LoadOptions, caches: CacheSizes, compute: int | None, free: int | None) -> None:
    """OptionError unless the caches (and, once measured, the compute buffer) fit in `free` bytes
    (None: unknown, not checked)."""
    need = caches.total + (compute or 0)
    if free is None or need <= free:
        return
    per_seq = f" ({options.n_seq} sequences of {options.n_ctx_seq})" if options.n_seq > 1 else ""
    raise OptionError(f"-c {options.n_ctx}{per_seq} does not fit in memory: {_describe(options, caches, compute)}; "
                      f"{human_size(free)} is free (MemAvailable). Use a smaller -c, fewer sequences (-np), "
                      "smaller cache types (-ctk, --cache-type-indexer) or a smaller -ub")
