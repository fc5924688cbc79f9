"""kimi-k3-doctor: can this machine run MODEL.gguf, and at which --mem-budget? MODEL may also be
a saved `convert_kimi_k3.py --dry-run` listing: the model sized before it is converted.

Reports the RAM (and the memory cgroup's limit), the free disk, the sequential read speed of
the GGUF's disk measured with a short bounded read (its pages dropped first, so the disk and not
the page cache is timed), the trunk and expert bytes, and per preset what --mem-budget would
read per token and the s/token that read alone costs at that speed. The prediction leaves out
the caches and compute buffer (they depend on -c): the runner's summary line gives the exact plan.
Bytes per token are the streamed trunks plus the experts a token selects that the expert cache
misses, predicted as if the router chose every expert equally often (BudgetPlan).
"""
from __future__ import annotations

from gguf_arch.errors.signals import install

install()  # first: a stop signal during the imports below is the documented line and code

import argparse
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Sequence

import psutil

from gguf_arch.errors import run_cli
from gguf_arch.io.console import ArgumentParser, UsageError
from gguf_arch.io.jsonfile import NotRegularFile, open_regular

from ..backends.streaming.budget import PRESETS, BudgetError, plan_budget
from ..weights.host import MODEL_SHARE, cgroup_limit, usable_memory
from ..backends.streaming.listing import ModelLayout, gguf_layout, is_listing, listing_layout

_CHUNK = 8 << 20
_READ_BYTES = 256 << 20  # the speed test reads at most this much...
_READ_SECONDS = 2.0  # ...or for at most this long


def read_speed(paths: Sequence[str]) -> float:
    """Bytes per second of a sequential read of the files, each from its start, one after the
    other (of a split GGUF: its first files), bounded in bytes and time, uncached."""
    done, start = 0, time.perf_counter()
    for path in paths:
        fd = open_regular(Path(path))  # never a FIFO (a wait) or a device (/dev/zero: no disk at all)
        try:
            os.posix_fadvise(fd, 0, _READ_BYTES, os.POSIX_FADV_DONTNEED)
            offset = 0
            while done < _READ_BYTES and time.perf_counter() - start < _READ_SECONDS:
                n = len(os.pread(fd, _CHUNK, offset))
                if not n:
                    break
                offset += n
                done += n
        finally:
            os.close(fd)
    return done / max(time.perf_counter() - start, 1e-9)


def report(path: Path, disk: Path | None = None) -> list[str]:
    """The doctor's lines for a GGUF or a saved dry-run listing (backends/streaming/listing.py). The read
    speed is measured on the GGUF's files, or on `disk` (a large file on the disk the GGUF is or
    will be on: a listing's GGUF may not exist yet)."""
    layout = listing_layout(path) if is_listing(path) else gguf_layout(path)
    speed_from = _disk_files(disk, layout) if disk is not None else [] if layout.planned else layout.paths
    speed = _speed(speed_from)
    mem, limit, usable = psutil.virtual_memory(), cgroup_limit(), usable_memory()
    where = Path(layout.paths[0]).resolve().parent
    lines = [f"RAM          {mem.total} bytes, {mem.available} available" +
             (f", cgroup limit {limit}" if limit else ", no cgroup limit"),
             _free_disk(where, layout.total if layout.planned else None),
             f"read speed   {speed / 1e6:.1f} MB/s (sequential, uncached, {len(speed_from)} file(s))" if speed else
             "read speed   not measured: the GGUF of a listing is not there yet; give --disk FILE, a large file "
             "on the disk it will be on",
             f"weights      trunk {layout.trunk} bytes, experts {layout.experts} bytes"
             + (f" (planned by {path})" if layout.planned else "")]
    lines += _presets(layout, speed, usable)
    return lines


def _disk_files(disk: Path, layout: ModelLayout) -> list[str]:
    """--disk: a regular file, or the GGUF's own directory (its files, then); anything else is
    refused by name, never read (a FIFO would block, /dev/zero would time no disk at all)."""
    try:
        st = os.stat(disk)
    except OSError as exc:
        raise UsageError(f"--disk {disk}: cannot be read: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        if not layout.planned and os.path.samefile(disk, Path(layout.paths[0]).parent):
            return layout.paths
        raise UsageError(f"--disk {disk}: is a directory; give a large file on the disk to measure (or the GGUF's "
                         "own directory)")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"--disk {disk}: is not a regular file (a FIFO, socket or device); give a large file on "
                         "the disk to measure")
    if st.st_size == 0:
        raise UsageError(f"--disk {disk}: is empty: nothing to time; give a large file on the disk to measure")
    return [str(disk)]


def _speed(paths: Sequence[str]) -> float | None:
    if not paths:
        return None
    try:
        return read_speed(paths)
    except (NotRegularFile, FileNotFoundError, IsADirectoryError) as exc:  # replaced since it was checked
        raise UsageError(f"{exc.filename or paths[0]}: cannot be measured ({exc})") from None


def _free_disk(where: Path, needed: int | None) -> str:
    if not where.is_dir():
        return f"free disk    {where} does not exist yet"
    free = shutil.disk_usage(where).free
    return f"free disk    {free} bytes" + ("" if needed is None else
                                           f" in {where} ({'enough' if free >= needed else 'not enough'} for the "
                                           f"{needed} bytes the conversion writes)")


def _presets(layout: ModelLayout, speed: float | None, usable: int) -> list[str]:
    """One line per preset (bytes and s/token per token), then the command to run."""
    lines, best = [], None
    for name, budget in PRESETS.items():
        try:
            p = plan_budget(budget, layout.outside, layout.layers, layout.sizes)
        except BudgetError:
            lines.append(f"preset {name:<12} {budget} bytes: too small for this model")
            continue
        b = p.predicted_bytes_per_token
        lines.append(f"preset {name:<12} {budget} bytes: pins {len(p.pinned)}/{len(layout.layers)} trunks, "
                     f"expert cache {p.cache_entries} experts, reads ~{b:.0f} bytes/token"
                     + (f", {b / speed:.3f} s/token at that speed" if speed else ""))
        best = name if budget <= usable else best
    return lines + [_command(layout, best, usable)]


def _command(layout: ModelLayout, preset: str | None, usable: int) -> str:
    """The command to run: no budget if the model fits, else the largest preset that does, else a
    budget of MODEL_SHARE of the usable memory (in whole GiB) when the model can be planned in it."""
    run = f"run: kimi-k3-cli -m {layout.paths[0]}"
    if layout.total <= usable:
        return run + "  (the whole model fits in memory)"
    if preset is not None:
        return f"{run} --mem-budget {preset}"
    budget = int(MODEL_SHARE * usable) >> 30 << 30
    try:
        plan_budget(budget, layout.outside, layout.layers, layout.sizes)
    except BudgetError:
        return f"run: not on this machine: {usable} bytes usable, too few for any --mem-budget plan of this model"
    return f"{run} --mem-budget {budget >> 30}G  (no preset fits in the {usable} bytes usable)"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, metavar="MODEL.gguf",
                   help="the GGUF (or the first file of a split), or the saved output of "
                        "convert_kimi_k3.py CKPT OUT --dry-run (the model before it is converted)")
    p.add_argument("--disk", type=Path, metavar="FILE", default=None,
                   help="measure the read speed on FILE (a large file on the disk the GGUF is or will be on) "
                        "instead of the GGUF's files")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    def run() -> None:
        a = build_parser().parse_args(argv)
        print("\n".join(report(a.model, a.disk)))
    return run_cli(run, runtime_errors=(OSError,))


if __name__ == "__main__":
    raise SystemExit(main())
