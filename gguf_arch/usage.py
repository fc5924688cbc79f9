"""The command line of every console script: one argparse style, one error style, one --version.

argparse's own error prints the whole usage block and then `PROG: error: ...`; the tools promise
one line, `error: ...` (exit 2, README's exit codes), so a bad argument here ends with that line
and a pointer to --help in it.
"""
from __future__ import annotations

import argparse
from importlib import metadata
from typing import Any, Sequence

from .errors import KimiError

PACKAGE = "kimi-k3-gguf"


class UsageError(KimiError):
    """A command-line argument is malformed or inconsistent (exit code 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error line and a lazily computed --version."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action=_VersionAction, help="print the versions of this tool, ggml and "
                                                                    "llama.cpp, then exit")

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


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
