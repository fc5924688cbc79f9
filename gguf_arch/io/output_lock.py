"""One conversion per output: an exclusive POSIX lock (fcntl) on `<OUT>.lock`, held for the run.

Two conversions to the same OUT would each remove the other's `.partial` (with --overwrite) or
interleave their parts; the second is refused at once instead, naming the holder's PID, which the
holder writes into the lock file. The lock goes with the process (a killed run leaves at most an
unlocked file, which the next run takes over); the holder removes the file when it is done.
"""
from __future__ import annotations

import errno
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import OutputError

LOCK_SUFFIX = ".lock"


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + LOCK_SUFFIX)


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
    except OSError:
        return "unknown"


def _acquire(out: Path, path: Path) -> int | None:
    """The locked descriptor, or None when the file was replaced between open and lock (retry)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OutputError(f"writing {out} failed: cannot create its lock file {path.name}: {exc.strerror}") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        pid = _holder(fd)
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise OutputError(f"{out}: another conversion (PID {pid}) is writing this output (lock {path.name}); "
                              "wait for it to finish or stop it") from None
        raise OutputError(f"{path}: cannot lock the output: {exc.strerror}") from None
    try:
        same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
    except FileNotFoundError:
        same = False  # the previous holder removed it after we opened it
    if not same:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold the output's lock for the body; OutputError at once when another process holds it."""
    path = lock_path(out)
    fd = None
    while fd is None:
        fd = _acquire(out, path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # still ours: nobody else can have locked it since
        os.close(fd)
