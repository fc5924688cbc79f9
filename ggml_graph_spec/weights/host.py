"""This host's memory: what a process may use, the memory cgroup's limit included (read by
kimi-k3-doctor and by the runner's choice of repacking the experts)."""
from __future__ import annotations

from pathlib import Path

import psutil

# The share of the usable memory a model may take (the runner's default repack, kimi-k3-doctor's
# suggested --mem-budget): the rest is for the caches, the compute buffers and what else runs.
MODEL_SHARE = 0.9


def cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max or v1 limit_in_bytes), if any."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, group = line.split(":", 2)
        if not controllers:
            f = Path("/sys/fs/cgroup") / group.lstrip("/") / "memory.max"
        elif "memory" in controllers.split(","):
            f = Path("/sys/fs/cgroup/memory") / group.lstrip("/") / "memory.limit_in_bytes"
        else:
            continue
        text = f.read_text().strip() if f.is_file() else "max"
        if text != "max" and int(text) < 1 << 60:  # v1 writes "no limit" as a huge number
            return int(text)
    return None


def usable_memory() -> int:
    """Bytes this process can expect to hold: the RAM available now, at most the cgroup's limit."""
    available, limit = psutil.virtual_memory().available, cgroup_limit()
    return min(available, limit or available)
