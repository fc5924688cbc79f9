"""Every file a run writes is claimed here before its first byte: one guard for all of them.

A run lists every path it will create (the GGUF or each split part, with its `.partial`, its
manifest and the manifest's `.partial`; the --log-json file; exported rules; anything added
later) and `OutputPaths.check` refuses, before anything is written:
- a path inside a directory the run reads (the model directory): --overwrite there could replace
  a shard being read, and a stray file among the shards is taken for part of the checkpoint (2);
- a path that is a file the run reads (kimi-k3-prune's IN.gguf, a calibration text) (2);
- two outputs of one run on the same path (`--log-json OUT.gguf`) (2);
- a name or a path longer than the output filesystem allows: found now, not after the last tensor (2);
- a symbolic link at the path, unless --overwrite, which replaces the link itself (1);
- an existing file, unless --overwrite (or --resume for the files it rewrites) (1);
- a directory at the path, or a parent that is not a directory (1).

The files are then opened with `create`, which never follows a link and never writes into a file
it found: what --overwrite allows to replace is unlinked first and the new file made with
O_CREAT | O_EXCL | O_NOFOLLOW, so a hard link or a planted symlink keeps its target's bytes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable

from ..errors import KimiError, OutputError

PARTIAL_SUFFIX = ".partial"
MANIFEST_SUFFIX = ".manifest.json"
LEGACY_MANIFEST_SUFFIX = ".sha256.json"  # manifests written before BLAKE3 (still read: io.manifest)


def names_a_directory(path: Path | str) -> bool:
    """A path given as text that ends in a separator (`out/`) or in `.` or `..` names a directory,
    even where none exists yet: Path("out/") is Path("out"), a file name, so it is caught here."""
    text = os.fspath(path)
    return isinstance(path, str) and (text.endswith(os.sep) or os.path.basename(text) in ("", ".", ".."))


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def manifest_path(gguf: Path | str) -> Path:
    gguf = Path(gguf)
    return gguf.with_name(gguf.name + MANIFEST_SUFFIX)


def legacy_manifest_path(gguf: Path | str) -> Path:
    gguf = Path(gguf)
    return gguf.with_name(gguf.name + LEGACY_MANIFEST_SUFFIX)


@dataclass(frozen=True)
class Output:
    path: Path
    what: str  # what the file is, for the message: "the GGUF", "the JSON progress log (--log-json)"
    replace: bool  # an existing file there may be replaced
    written: bool = True  # False: a finished file --resume keeps (its path still may not be reused)


def _where(path: Path) -> str:
    """The path with its directory resolved (links in the directories followed, not the name's)."""
    return os.path.join(os.path.realpath(path.parent), path.name)


def _name_limits(path: Path) -> str | None:
    """Why the filesystem cannot hold this name, or None. Limits of the nearest existing directory."""
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    name_max = os.pathconf(parent, "PC_NAME_MAX")
    path_max = os.pathconf(parent, "PC_PATH_MAX")
    if len(os.fsencode(path.name)) > name_max:
        return f"its name is {len(os.fsencode(path.name))} bytes, the filesystem allows {name_max}"
    if len(os.fsencode(_where(path))) >= path_max:
        return f"its full path is {len(os.fsencode(_where(path)))} bytes, the system allows {path_max - 1}"
    return None


class OutputPaths:
    """The outputs of one run, checked together against each other and against what exists."""

    def __init__(self, read_dirs: Iterable[tuple[Path, str]] = (),
                 read_files: Iterable[tuple[Path, str]] = (), *, resumable: bool = True) -> None:
        self.read_dirs = [(Path(os.path.realpath(d)), what) for d, what in read_dirs]
        self.read_files = {os.path.realpath(f): (Path(f), what) for f, what in read_files}
        self.outputs: list[Output] = []
        self.resumable = resumable  # the tool has --resume: the messages point to it

    def add(self, path: Path | str, what: str, *, replace: bool, written: bool = True) -> None:
        if names_a_directory(path):
            raise KimiError(f"{path}: names a directory; give {what} a file name")
        self.outputs.append(Output(Path(path), what, replace, written))

    def add_gguf(self, path: Path, what: str, *, replace: bool, written: bool = True) -> None:
        """A GGUF and the files that come with it (a version-1 manifest left under its old name
        would describe an earlier file: it is replaced like the others)."""
        for p, w in ((path, what), (partial_path(path), f"{what}'s partial file"),
                     (manifest_path(path), f"{what}'s manifest"),
                     (partial_path(manifest_path(path)), f"{what}'s partial manifest"),
                     (legacy_manifest_path(path), f"{what}'s earlier (SHA-256) manifest")):
            self.add(p, w, replace=replace, written=written)

    def check(self, *, existing: bool = True) -> None:
        """Raise at the first problem; `existing=False` checks only names and places (no file is
        compared with what is on disk yet: the names of split parts are not known yet)."""
        seen: dict[str, Output] = {}
        for o in self.outputs:
            _check_place(o, self.read_dirs)
            if os.path.realpath(o.path) in self.read_files:
                path, what = self.read_files[os.path.realpath(o.path)]
                raise KimiError(f"{o.path}: is {what} ({path}), which this run reads; write {o.what} elsewhere")
            other = seen.setdefault(_where(o.path), o)
            if other is not o:
                raise KimiError(f"{o.path}: both {other.what} and {o.what} of this run would be written there; "
                                "give them different names")
        if existing:
            for o in self.outputs:
                if o.written:
                    check_existing(o.path, o.replace, o.what, self.resumable)


def guard_outputs(outputs: Iterable[tuple[Path, str]], *, reads: Iterable[tuple[Path, str]], replace: bool) -> None:
    """The guard for a tool that writes whole small files (`atomic.write_atomically`): each output
    and its `.partial`, against each other, the files the run reads and what exists."""
    guard = OutputPaths(read_files=reads, resumable=False)
    for path, what in outputs:
        guard.add(path, what, replace=replace)
        guard.add(partial_path(Path(path)), f"{what}'s partial file", replace=replace)
    guard.check()


def _check_place(o: Output, read_dirs: list[tuple[Path, str]]) -> None:
    where = Path(os.path.realpath(o.path.parent))
    for d, what in read_dirs:
        if where == d or d in where.parents:
            raise KimiError(f"{o.path}: is inside {what} {d}; write {o.what} elsewhere")
    why = _name_limits(o.path)
    if why is not None:
        raise KimiError(f"{o.path}: cannot be created for {o.what}: {why}; choose a shorter name")


def check_existing(path: Path, replace: bool, what: str = "the output", resumable: bool = True) -> None:
    """Refuse an existing file (or link) at `path` unless it may be replaced; refuse a directory.
    `resumable`: the tool has --resume, which the messages then offer."""
    if path.name.endswith(PARTIAL_SUFFIX) and os.path.lexists(path) and not replace:
        how = "use --resume to continue that conversion, or --overwrite" if resumable else "or use --overwrite"
        raise OutputError(f"{path}: exists, left by an interrupted run or one still running (delete it, {how})")
    if path.is_symlink() and not replace:
        raise OutputError(f"{path}: is a symbolic link to {os.readlink(path)}; refusing to write through it "
                          "(use --overwrite to replace the link itself; its target is never written)")
    if path.exists() and not replace:
        resume = ", or --resume to continue the conversion that wrote it" if resumable else ""
        raise OutputError(f"{path}: already exists (use --overwrite to replace it{resume})")
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"{path}: is a directory")
    if os.path.lexists(path) and not (path.is_symlink() or path.is_file()):
        # --overwrite unlinks what it replaces: never a device (/dev/null), FIFO or socket
        raise OutputError(f"{path}: is not a regular file (a device, FIFO or socket); refusing to replace it")
    if not path.parent.is_dir():
        raise OutputError(f"{path}: cannot write {what}: output directory does not exist ({path.parent})")


def remove_leftover(path: Path) -> None:
    """Unlink a file or link that may be replaced (never its target)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        raise OutputError(f"{path}: cannot remove it to write the new file: {exc.strerror}") from None


def create(path: Path, replace: bool, mode: str = "wb") -> IO:
    """A new file at `path`, opened for writing; never through a link, never into an existing file.
    OSError (permissions, a full disk) is left to the caller, which names what it was writing."""
    check_existing(path, replace)
    if replace:
        remove_leftover(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except FileExistsError:
        raise OutputError(f"{path}: appeared while this run was starting (another process writing there?); "
                          "refusing to write over it") from None
    return open(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
