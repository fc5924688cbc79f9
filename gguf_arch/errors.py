"""Errors the tools report as one line, and the exit codes they map to.

Exit codes (documented in README.md):
  0  success
  1  a runtime failure outside the input's fault (I/O error, disk full, interrupted write)
  2  bad input: config, checkpoint, tokenizer, GGUF or command-line arguments
  130 interrupted by the user (Ctrl-C)
"""
from __future__ import annotations

import re
import sys
from typing import Callable

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130

# Everything str.splitlines() breaks on, and the other C0/C1 controls (a terminal escape in a tensor
# name must not recolour or rewrite the user's terminal).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class KimiError(Exception):
    """Base class: the message is a complete one-line explanation."""

    exit_code = EXIT_BAD_INPUT

    def __str__(self) -> str:
        # Messages quote names and values taken from the input; escaping their control characters
        # keeps the promise of one line whatever a hostile file contains.
        return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), super().__str__())


class ConfigError(KimiError):
    """config.json is missing a field, has a wrong value, or is inconsistent."""


class CheckpointError(KimiError):
    """A safetensors shard, the index or a tensor disagrees with the config."""


class TokenizerError(KimiError):
    """tiktoken.model or tokenizer_config.json is missing or malformed."""


class GGUFError(KimiError):
    """A GGUF file is malformed or does not match the kimi-k3 tables."""


class OutputError(KimiError):
    """The output cannot be written (exists, unwritable, disk full)."""

    exit_code = EXIT_RUNTIME


def run_cli(action: Callable[[], int | None], *, interrupted: str = "interrupted",
            runtime_errors: tuple[type[BaseException], ...] = (OSError,)) -> int:
    """Run a command-line tool's body and turn every expected failure into one stderr line and
    its exit code: the contract every CLI of this project documents (never a traceback)."""
    try:
        code = action()
    except KimiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"error: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except runtime_errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK if code is None else code
