"""A child process that cannot take the machine's memory: for tests where a failed check would
allocate without end (a server's device count of 2^32-1 once made ggml's client allocate until
the OOM killer came).

`memory_limited(limit)` yields a preexec_fn for subprocess: the child joins a memory cgroup of
its own (cgroup v1, a child of this process's own group, so the limit counts inside it) capped
at `limit` bytes, where the memory controller is there to write to; elsewhere an address-space
limit (RLIMIT_AS) of the same size. Past the limit the child is killed or gets MemoryError: the
test fails, the machine does not.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import resource
from pathlib import Path
from typing import Callable, Iterator

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
_SERIAL = itertools.count()


def _own_memory_group() -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                return CGROUP_V1_MEMORY / path.lstrip("/")
    except OSError:
        pass
    return None


def _new_group(limit: int) -> Path | None:
    parent = _own_memory_group()
    if parent is None or not os.access(parent, os.W_OK):
        return None
    group = parent / f"kimi-k3-test-{os.getpid()}-{next(_SERIAL)}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return None
    return group


@contextlib.contextmanager
def memory_limited(limit: int) -> Iterator[Callable[[], None]]:
    group = _new_group(limit)

    def join() -> None:  # runs in the child, before exec
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))
        else:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        yield join
    finally:
        if group is not None:
            with contextlib.suppress(OSError):
                group.rmdir()  # empty once the child is gone
