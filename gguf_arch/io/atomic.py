"""Small outputs (a saliency JSON, an imatrix GGUF) written whole or not at all.

The data goes to `<out>.partial`, is fsync'd and renamed over the final name; an error or Ctrl-C
removes the partial file, so a user's existing file is replaced only by a complete new one.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ..errors import OutputError


def check_new_output(path: Path, overwrite: bool) -> None:
    """Refuse an existing output (a link too) unless asked to replace it; checked before any work."""
    if path.is_dir():
        raise OutputError(f"{path}: is a directory")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise OutputError(f"{path}: already exists (use --overwrite to replace it)")
    if not path.parent.is_dir():
        raise OutputError(f"{path.parent}: output directory does not exist")


@contextmanager
def removed_on_failure(tmp: Path, out: Path) -> Iterator[None]:
    """Delete the partial file `tmp` if the block fails; an OSError becomes one line about `out`."""
    try:
        yield
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"writing {out} failed: {exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a temporary file next to `path`, which then replaces `path`."""
    tmp = path.with_name(path.name + ".partial")
    with removed_on_failure(tmp, path):
        tmp.unlink(missing_ok=True)
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
