"""Errors the tools report as one line, and the exit codes they map to.

Exit codes (documented in README.md):
  0  success
  1  a runtime failure outside the input's fault (I/O error, disk full, interrupted write)
  2  bad input: config, checkpoint, tokenizer, GGUF or command-line arguments
  129 hung up (SIGHUP), 130 interrupted by the user (Ctrl-C, SIGINT), 143 terminated (SIGTERM):
     128 + the signal, each handled like Ctrl-C: one line saying what is left
  141 the reader of stdout went away (`| head`): the tool stops quietly, as on SIGPIPE
"""
from __future__ import annotations

import os
import re
import signal
import sys
from typing import Callable, NoReturn

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_HANGUP = 128 + signal.SIGHUP
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
# The signals a tool stops on as on Ctrl-C (SIGINT raises KeyboardInterrupt by itself).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

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


class Interrupted(BaseException):
    """A stop signal (SIGINT, SIGTERM, SIGHUP), raised where the main thread is, like
    KeyboardInterrupt; `what` says what the run leaves behind (set by whoever knows it)."""

    def __init__(self, signum: int, what: str | None = None) -> None:
        super().__init__(signum, what)
        self.signum, self.what = signum, what

    @classmethod
    def from_exc(cls, exc: BaseException, what: str) -> "Interrupted":
        return cls(getattr(exc, "signum", signal.SIGINT), what)


def _raise_interrupted(signum: int, _frame) -> NoReturn:
    raise Interrupted(signum)


def _stop_on_signals() -> dict[int, object]:
    """SIGTERM and SIGHUP raise Interrupted (only the main thread may set handlers); returns the
    handlers they replaced."""
    try:
        return {s: signal.signal(s, _raise_interrupted) for s in STOP_SIGNALS}
    except ValueError:  # not the main thread: leave the signals alone
        return {}


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
    what = getattr(exc, "what", None) or default
    return f"error: interrupted ({signal.Signals(signum).name})" + (f"; {what}" if what else ""), 128 + signum


def run_cli(action: Callable[[], int | None], *, interrupted: str | None = None,
            runtime_errors: tuple[type[BaseException], ...] = (OSError,)) -> int:
    """Run a command-line tool's body and turn every expected failure into one stderr line and
    its exit code: the contract every CLI of this project documents (never a traceback).
    SIGTERM and SIGHUP stop it like Ctrl-C; a closed stdout pipe stops it quietly."""
    previous = _stop_on_signals()
    try:
        code = action()
    except KimiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (KeyboardInterrupt, Interrupted) as exc:
        line, code = interrupted_line(exc, interrupted)
        print(line, file=sys.stderr)
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except runtime_errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return EXIT_OK if code is None else code

