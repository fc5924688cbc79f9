"""llama-server's slot actions: `POST /slots/{id}?action=save|restore` with `{"filename": ...}` and
`action=erase`, in the engine's one state format (engine/state.py: a file written whole or not
at all, refused with one line when it is not one, damaged, or of another model or cache type).

Files live in --slot-save-path only: a filename is a plain name, never a path. A save is
written whole or not at all (a partial file renamed over the name once complete): a full disk or
a read-only directory is a 500 saying so, and a file of that name is as it was. A restore reads a
regular file of at most any state's size of this context, never a FIFO (it would wait forever).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

from gguf_arch.errors import OutputError

from ..engine.model import Model
from ..engine.state import StateError
from .errors import SERVER, ApiError, bad_request
from .slots import Slot

ACTIONS = ("save", "restore", "erase")
# llama.cpp's fs_validate_filename in spirit: one plain name, no separators, no leading dot.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")


def check_filename(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise bad_request(f"'filename' must be a plain file name (letters, digits, '_', '-', '.'; no path), "
                          f"got {name!r}"[:200])
    return name


class SlotFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def run(self, model: Model, slot: Slot, action: str, filename: str | None) -> dict:
        """One action on an idle slot (the engine thread runs it between steps)."""
        t = time.perf_counter()
        if action == "erase":
            n = model.seq_pos(slot.id)
            model.seq_rm(slot.id)
            slot.history, slot.checkpoints = [], type(slot.checkpoints)()
            return {"id_slot": slot.id, "n_erased": n}
        path = self.directory / check_filename(filename)
        try:
            if action == "save":
                n_bytes = model.state_save(slot.id, path)
                return {"id_slot": slot.id, "filename": filename, "n_saved": model.seq_pos(slot.id),
                        "n_written": n_bytes, "timings": {"save_ms": (time.perf_counter() - t) * 1e3}}
            n = model.state_load(slot.id, path)
        except StateError as exc:
            raise bad_request(self._private(exc)) from None
        except (OutputError, OSError) as exc:  # a full disk, a read-only directory: nothing was replaced
            raise ApiError(500, SERVER, f"slot {slot.id}: saving {filename!r} failed ({self._private(exc)}); a "
                                        "file of that name is as it was") from None
        slot.history = model.seq_tokens(slot.id)
        return {"id_slot": slot.id, "filename": filename, "n_restored": n, "n_read": path.stat().st_size,
                "timings": {"restore_ms": (time.perf_counter() - t) * 1e3}}

    def _private(self, exc: Exception) -> str:
        """A message without the server's directory (clients are not told where it keeps files)."""
        return str(exc).replace(str(self.directory) + "/", "").replace(str(self.directory), "the slot directory")
