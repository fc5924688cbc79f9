"""Opening a GGUF given by the user with gguf-py: one line naming the file for every failure.

The runner's loader, `--verify` and the tensor diff all open GGUFs through `open_gguf`. The bytes
of a row of each GGML type (`row_nbytes`) are written here once for the writer and the readers.
"""
from __future__ import annotations

import os
from pathlib import Path

from gguf import GGUFReader, GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from ..errors import GGUFError
from .jsonfile import NotRegularFile, open_regular


def row_nbytes(ggml_type: GGMLQuantizationType, row: int) -> int:
    """Bytes of `row` values of `ggml_type` (whole blocks; the caller checks the row fills them)."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    return row // block * size


def open_gguf(path: Path) -> GGUFReader:
    """gguf-py's reader of `path` (memory-mapped, read-only)."""
    try:
        # np.memmap opens the path itself: a FIFO under the name would block it forever.
        os.close(open_regular(path))
        return GGUFReader(path, "r")
    except FileNotFoundError:
        raise GGUFError(f"{path}: not found") from None
    except NotRegularFile as exc:
        raise GGUFError(f"{path}: {exc}") from None
    except (OSError, ValueError, IndexError, KeyError, TypeError) as exc:
        # gguf-py reports a malformed or truncated file through whatever numpy raised.
        raise GGUFError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
