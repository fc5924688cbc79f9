"""Errors the tools report as one line, and the exit codes they map to.

Exit codes (documented in README.md):
  0  success
  1  a runtime failure outside the input's fault (I/O error, disk full, interrupted write)
  2  bad input: config, checkpoint, tokenizer, GGUF or command-line arguments
  129 hung up (SIGHUP), 130 interrupted by the user (Ctrl-C, SIGINT), 143 terminated (SIGTERM):
     128 + the signal, each handled like Ctrl-C: one line saying what is left (Ctrl-C at
     kimi-k3-cli's conversation prompt is its normal end: 130 without that line)
  141 the reader of stdout went away (`| head`): the tool stops quietly, as on SIGPIPE
"""
from __future__ import annotations

import os
import re
import signal
import sys
from typing import Callable

from . import signals
from .signals import Interrupted, STOP_SIGNALS  # noqa: F401  (the tools import them from here)

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_HANGUP = 128 + signal.SIGHUP
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

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


def _quiet_stdout() -> None:
    """The reader of stdout is gone: point stdout at /dev/null so the interpreter's final flush
    does not print a BrokenPipeError of its own."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):
        pass


def interrupted_line(exc: BaseException, default: str | None) -> tuple[str, int]:
    """(`error: interrupted (SIGNAME); what is left`, 128 + the signal) for a stop signal."""
    signum = getattr(exc, "signum", signal.SIGINT)
    return signals.interrupted_line(signum, getattr(exc, "what", None) or default), 128 + signum


def run_cli(action: Callable[[], int | None], *, interrupted: str | None = None,
            runtime_errors: tuple[type[BaseException], ...] = (OSError,)) -> int:
    """Run a command-line tool's body and turn every expected failure into one stderr line and
    its exit code: the contract every CLI of this project documents (never a traceback).
    SIGINT, SIGTERM and SIGHUP stop it alike (signals.py); a closed stdout pipe stops it quietly."""
    code = _run(action, interrupted, runtime_errors)
    signals.finished(code)
    return code


def _run(action: Callable[[], int | None], interrupted: str | None,
         runtime_errors: tuple[type[BaseException], ...]) -> int:
    try:
        with signals.tool_body(interrupted):
            code = action()
    except KimiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # Interrupted too: SIGTERM and SIGHUP
        line, code = interrupted_line(exc, interrupted)
        print(line, file=sys.stderr)
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except runtime_errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK if code is None else code
