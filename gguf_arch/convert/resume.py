"""Which output files a conversion still has to write: leftovers refused, or with --resume verified.

Each output file (the GGUF, or each split part) is renamed into place only when complete, and its
`<file>.manifest.json` manifest (gguf_arch.io.manifest) is written after it. So after a Ctrl-C, kill
or power loss a file at its final name is a finished one, unless the run died between the two
renames (no manifest) or the file was damaged since. `--resume` therefore trusts nothing: a file
is kept only when its manifest describes exactly the planned file (size, header digest, every
tensor's name, type and size) and the file's header and every tensor hash to the stored digests.
Anything else, and every `.partial`, is rewritten from the checkpoint; a kept file is never
written again, so nothing is duplicated.

The check covers what is written, not where it came from: resuming against a different
checkpoint with the same config, tokenizer and tensor names would keep the earlier parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import OutputError
from ..io.digests import hash_bytes
from ..io.manifest import IntegrityError, check_hashes, found_manifest_path, read_manifest
from ..io.gguf_writer import GGUFLayout, file_size, header_bytes


@dataclass(frozen=True)
class OutputFile:
    path: Path
    layout: GGUFLayout
    size: int  # exact bytes once written

    @classmethod
    def planned(cls, path: Path, layout: GGUFLayout) -> "OutputFile":
        return cls(path, layout, file_size(layout))


def _mismatch(f: OutputFile, threads: int) -> str | None:
    """Why the file at f.path is not the finished planned file, or None when it is."""
    try:
        manifest = read_manifest(f.path)
    except IntegrityError as exc:
        return str(exc)
    planned = [(t.name, t.ggml_type.name, t.nbytes) for t in f.layout.tensors]
    if manifest.gguf_size != f.size:
        return f"its manifest records {manifest.gguf_size} bytes, the plan needs {f.size}"
    if manifest.header != hash_bytes(manifest.hash, header_bytes(f.layout)):
        return "its header (metadata or tensor list) differs from this conversion's"
    if [(d.name, d.ggml_type, d.nbytes) for d in manifest.tensors] != planned:
        return "its manifest lists other tensors than this conversion plans for it"
    try:
        check_hashes(f.path, manifest, threads=threads)
    except IntegrityError as exc:
        return str(exc)
    return None


def files_to_write(files: list[OutputFile], log: Callable[[str], None], threads: int = 1) -> list[OutputFile]:
    """--resume: the files not verified as finished; each finished one is re-hashed (on `threads`
    cores), not trusted."""
    todo = []
    for f in files:
        if f.path.is_symlink():
            raise OutputError(f"{f.path}: is a symbolic link; --resume writes only files it made itself")
        if not f.path.exists():
            todo.append(f)
            continue
        why = _mismatch(f, threads)
        if why is None:
            log(f"{f.path}: finished earlier, verified against {found_manifest_path(f.path).name}; kept")
        else:
            log(f"{f.path}: not a verified finished file ({why}); rewriting it")
            todo.append(f)
    return todo


def left_behind(files: list[OutputFile], todo: list[OutputFile], done: list[OutputFile]) -> str:
    """After an interrupt: what the output holds now, and what --resume would do with it."""
    written = {id(f) for f in done}
    finished = [f for f in files if id(f) in written or not any(f is t for t in todo)]
    unmanifested = [f for f in todo if id(f) not in written and f.path.exists()]
    if len(files) == 1 and not finished:
        what = "no output written (its partial file was removed)"
    elif not finished:
        what = f"none of the {len(files)} parts complete (the partial file was removed)"
    elif len(files) == 1:
        what = f"{files[0].path.name} is complete with its manifest (the interrupt came after it)"
    else:
        names = ", ".join(f.path.name for f in finished)
        what = f"{len(finished)} of {len(files)} parts complete with their manifests ({names})"
    if unmanifested:
        what += f"; {unmanifested[0].path.name} is complete but has no manifest yet"
    if finished or unmanifested:
        return what + "; the same command with --resume keeps what is complete and writes the rest"
    return what + "; run the conversion again (--resume has nothing to keep)"
