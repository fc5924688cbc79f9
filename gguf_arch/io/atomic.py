"""Small outputs (a saliency JSON, an imatrix GGUF) written whole or not at all.

The run claims its outputs first (`output_paths.guard_outputs`). The data goes to `<out>.partial`,
is fsync'd and renamed over the final name; an error or Ctrl-C removes the partial file, so a user's existing file is replaced only by a complete new one.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ..errors import OutputError
from .output_paths import create, partial_path


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
    tmp = partial_path(path)
    with removed_on_failure(tmp, path):
        create(tmp, replace=True).close()  # a fresh file: never through a link planted at the partial name
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
