"""Reading a file given by the user: every way it can fail becomes one line naming the file.

config.json, tokenizer_config.json, the safetensors index, the integrity manifest and
tiktoken.model all go through `read_text` (the JSON ones through `read_json`), so none of them
can forget a failure mode: a FIFO planted under the name would block a plain open() forever, and
a 100,000-deep array makes `json.loads` raise RecursionError, which is not a ValueError. The
safetensors shards share `open_regular`.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import KimiError


class NotRegularFile(OSError):
    """The path names a directory, FIFO, socket or device."""


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, refusing anything but a regular file without waiting on it
    (O_NONBLOCK: opening a FIFO must not block until a writer comes)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
        raise NotRegularFile(f"is {kind}")
    return fd


def read_text(path: Path, error: type[KimiError], missing: str) -> str:
    """The file's UTF-8 text; `error(f"{path}: {missing}")` when the file does not exist."""
    try:
        with open(open_regular(path), "rb") as f:
            return f.read().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except NotRegularFile as exc:
        raise error(f"{path}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot be read: {exc}") from None


def read_json(path: Path, error: type[KimiError], missing: str, invalid: str = "invalid JSON") -> Any:
    """The parsed document; `error(f"{path}: {missing}")` when the file does not exist."""
    text = read_text(path, error, missing)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: {invalid}: {exc}") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply") from None


def not_unicode(value: Any) -> str | None:
    """The path (`messages[0].content`) of the first string, key or value, of a parsed JSON value
    that UTF-8 cannot encode ("" for the value itself), or None: JSON's \\uXXXX escapes can
    spell half a surrogate pair, which json.loads accepts and a tokenizer cannot encode.
    Iterative: the nesting is bounded only by json.loads."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                stack.append((f"{path}.{k}" if path else k, item))
                stack.append((f"{path}.{k}" if path else k, k))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(v))))
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path.encode("utf-8", "backslashreplace").decode()
    return None
