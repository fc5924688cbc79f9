"""What every console script shares: one argparse style, one error style, one --version, the
progress bar of a long step, and how sizes and long lists are written.

argparse's own error prints the whole usage block and then `PROG: error: ...`; the tools promise
one line, `error: ...` (exit 2, README's exit codes), so a bad argument here ends with that line
and a pointer to --help in it.
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Sequence

from tqdm import tqdm

from ..errors import KimiError
from .output_paths import names_a_directory

PACKAGE = "kimi-k3-gguf"


class UsageError(KimiError):
    """A command-line argument is malformed or inconsistent (exit code 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error line, a lazily computed --version, and options matched
    whole, as llama.cpp matches them.

    argparse reads an option it does not know by its prefix: `--chat-template` as an abbreviation
    of `--chat-template-file`, and a single-dash word as a one-letter option glued to its value
    (`-ngl 99` became `-n gl`, `-fa` became `-f a`). Here an option is one whole word or nothing:
    an unknown one is refused by its own name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action=_VersionAction, help="print the versions of this tool, ggml and "
                                                                    "llama.cpp, then exit")

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")

    def _get_option_tuples(self, option_string: str) -> list:  # type: ignore[override]
        # argparse's prefix matching (the source of both misreadings above): no candidates, so an
        # option that is not spelled out exactly (or as `--name=value`) is an unknown one.
        return []

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extra = super().parse_known_args(args, namespace)
        for action in self._actions:
            bad = _undecodable(getattr(parsed, action.dest, None)) if action.type is not Path else None
            if bad is not None:
                name = "/".join(action.option_strings) or action.metavar or action.dest
                self.error(f"{name}: {bad!r} is not valid UTF-8 text (the byte {_first_byte(bad)}); "
                           "text options take UTF-8")
        return parsed, extra


def _undecodable(value: Any) -> str | None:
    """The first string in `value` (a string, or the items of a list or tuple) holding bytes that
    were not UTF-8: Python decodes such command-line bytes to lone surrogates. A path (type=Path)
    may hold them, as Linux allows; text given to the model, a template or a key may not."""
    if isinstance(value, str):
        return value if any("\udc80" <= c <= "\udcff" for c in value) else None
    if isinstance(value, (list, tuple)):
        return next((bad for v in value if (bad := _undecodable(v)) is not None), None)
    return None


def _first_byte(text: str) -> str:
    return next(f"0x{ord(c) - 0xdc00:02x}" for c in text if "\udc80" <= c <= "\udcff")


def output_file(text: str) -> Path:
    """argparse type of an output FILE: a name ending in a path separator (or `.`, `..`) names a
    directory, and Path() would silently drop the slash and write a file of that name."""
    if names_a_directory(text):
        raise argparse.ArgumentTypeError(f"{text!r} names a directory; give the output file's name")
    return Path(text)


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask), not the machine's: the default and
    the cap of a tool's threads."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _llama_cpp_line() -> str:
    if _installed("llama-cpp-python") is None:
        return "llama.cpp: not installed (llama-cpp-python, the interop extra: pip install 'kimi-k3-gguf[interop]')"
    import llama_cpp  # loads libllama: only for --version

    return f"llama.cpp {llama_cpp.llama_version().decode()} (llama-cpp-python {llama_cpp.__version__})"


def version_lines(prog: str) -> list[str]:
    """This tool's version and the two runtimes it is built against: ggml (ggml-python, which the
    graph runs on) and llama.cpp (llama-cpp-python, which the interop tests run against)."""
    import ggml  # here, not at import time: loading ggml's library is for the tools that run it

    return [
        f"{prog} {_installed(PACKAGE) or '(not installed)'} ({PACKAGE})",
        f"ggml {ggml.ggml_version().decode()} (ggml-python {_installed('ggml-python')})",
        _llama_cpp_line(),
    ]


class _VersionAction(argparse.Action):
    # argparse's own version action formats its text when the parser is built; this one looks the
    # versions up only when --version is given, and like it exits before required arguments are checked.
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print("\n".join(version_lines(parser.prog)))
        parser.exit()


def task_bar(desc: str, total: int, *, enabled: bool, unit: str = "tensor", in_bytes: bool = False) -> tqdm:
    """A bar on stderr for one step of --verify or kimi-k3-diff (a no-op object when not enabled:
    stderr is not a terminal). It disappears when closed: the result lines stay, the bar does not."""
    return tqdm(total=total, desc=desc, unit="B" if in_bytes else unit, unit_scale=in_bytes, unit_divisor=1024,
                file=sys.stderr, disable=not enabled, dynamic_ncols=True, leave=False)


_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_size(n: int) -> str:
    """1023 -> '1023 bytes', 1536 -> '1.50 KiB', 6.2e9 -> '5.77 GiB': three significant digits, the
    largest binary unit that keeps the number at least 1 (never '0.00 GiB')."""
    if n < 1024:
        return f"{n} bytes"
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    digits = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:.{digits}f} {_UNITS[unit]}"


def summarised(items: Iterable[str], shown: int = 3) -> str:
    """'a, b, c' or 'a, b, c ... and 4 more': a list in a note stays one short line."""
    items = list(items)
    head = ", ".join(items[:shown])
    return head if len(items) <= shown else f"{head} ... and {len(items) - shown} more"
