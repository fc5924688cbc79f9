"""Checks made before the first output byte: is there room for the exact planned output?

The source side is checked when the checkpoint is opened (`io.safetensors.open_checkpoint`:
every shard listed in the index exists and is at least as long as its header says, exit 2); this
module adds the output side, the free space of the output filesystem (exit 1).

Headroom: 64 MiB plus 1% of the planned bytes, on top of the exact size. It covers the manifests
(a few hundred bytes per tensor), the filesystem's own block and extent metadata for the new files,
and other writers on the same disk during a conversion of hours.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import OutputError

HEADROOM_BYTES = 64 << 20
HEADROOM_FRACTION = 0.01


def headroom(planned: int) -> int:
    return HEADROOM_BYTES + int(planned * HEADROOM_FRACTION)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_free_space(out_dir: Path, planned: int) -> None:
    """OutputError unless `out_dir`'s filesystem has `planned` bytes plus the headroom free."""
    free = shutil.disk_usage(out_dir).free
    need = planned + headroom(planned)
    if free < need:
        raise OutputError(f"{out_dir}: {_gib(free)} free, the output needs {_gib(planned)} ({planned} bytes) "
                          f"plus {_gib(need - planned)} headroom; free space or choose another output directory")
