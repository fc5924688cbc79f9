"""Errors the tools report as one line, and the exit codes they map to.

Exit codes (documented in README.md):
  0  success
  1  a runtime failure outside the input's fault (I/O error, disk full, interrupted write)
  2  bad input: config, checkpoint, tokenizer, GGUF or command-line arguments
  130 interrupted by the user (Ctrl-C)
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class KimiError(Exception):
    """Base class: the message is a complete one-line explanation."""

    exit_code = EXIT_BAD_INPUT


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
