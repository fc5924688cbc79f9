"""kimi-k3-doctor: can this machine run MODEL.gguf, and at which --mem-budget?

Reports the RAM (and the memory cgroup's limit), the free disk, the sequential read speed of
the GGUF's disk measured with a short bounded read (its pages dropped first, so the disk and not
the page cache is timed), the trunk and expert bytes, and per preset what --mem-budget would
read per token and the s/token that read alone costs at that speed. The prediction leaves out
the caches and compute buffer (they depend on -c): the runner's summary line gives the exact plan.
Bytes per token are the streamed trunks plus the experts a token selects that the expert cache
misses, predicted as if the router chose every expert equally often (BudgetPlan).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

import psutil

from gguf_arch.errors import run_cli
from gguf_arch.io.console import ArgumentParser

from ..loader import load_gguf
from .budget import PRESETS, BudgetError, plan_budget
from .host import cgroup_limit, usable_memory
from .streaming import LayerFiles

_CHUNK = 8 << 20
_READ_BYTES = 256 << 20  # the speed test reads at most this much...
_READ_SECONDS = 2.0  # ...or for at most this long


def read_speed(paths: Sequence[str]) -> float:
    """Bytes per second of a sequential read from the start of the files (bounded, uncached)."""
    done, start = 0, time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, _READ_BYTES, os.POSIX_FADV_DONTNEED)
            while done < _READ_BYTES and time.perf_counter() - start < _READ_SECONDS:
                n = len(os.pread(fd, _CHUNK, done))
                if not n:
                    break
                done += n
        finally:
            os.close(fd)
    return done / max(time.perf_counter() - start, 1e-9)


def report(path: Path) -> list[str]:
    weights = load_gguf(path)
    try:
        files = LayerFiles(weights)
        layers, experts, outside = files.layer_bytes(), files.expert_bytes(), files.outside
        sizes = files.expert_sizes(weights.cfg.num_experts_used)
        paths = [p for p, _, _ in weights.mapped_files]
        files.close()
    finally:
        weights.close()
    mem, limit, usable = psutil.virtual_memory(), cgroup_limit(), usable_memory()
    speed = read_speed(paths)
    lines = [f"RAM          {mem.total} bytes, {mem.available} available" +
             (f", cgroup limit {limit}" if limit else ", no cgroup limit"),
             f"free disk    {shutil.disk_usage(Path(path).resolve().parent).free} bytes",
             f"read speed   {speed / 1e6:.1f} MB/s (sequential, uncached, {len(paths)} file(s))",
             f"weights      trunk {sum(layers) + outside} bytes, experts {experts} bytes"]
    best = None
    for name, budget in PRESETS.items():
        try:
            p = plan_budget(budget, outside, layers, sizes)
            b = p.predicted_bytes_per_token
            lines.append(f"preset {name:<12} {budget} bytes: pins {len(p.pinned)}/{len(layers)} trunks, "
                         f"expert cache {p.cache_entries} experts, reads ~{b:.0f} bytes/token, "
                         f"{b / speed:.3f} s/token at that speed")
            best = name if budget <= usable else best
        except BudgetError:
            lines.append(f"preset {name:<12} {budget} bytes: too small for this model")
    fits = sum(layers) + outside + experts <= usable
    lines.append(f"run: kimi-k3-cli -m {path}" + ("" if fits or best is None else f" --mem-budget {best}")
                 + ("  (the whole model fits in memory)" if fits else ""))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, metavar="MODEL.gguf", help="the GGUF (or the first file of a split)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda: print("\n".join(report(build_parser().parse_args(argv).model))),
                   runtime_errors=(OSError,))


if __name__ == "__main__":
    raise SystemExit(main())
