"""Reading a JSON file given by the user: every way it can fail becomes one line naming the file.

config.json, tokenizer_config.json, the safetensors index and the integrity manifest all go
through `read_json`, so none of them can forget a failure mode (a 100,000-deep array makes
`json.loads` raise RecursionError, which is not a ValueError).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import KimiError


def read_json(path: Path, error: type[KimiError], missing: str, invalid: str = "invalid JSON") -> Any:
    """The parsed document; `error(f"{path}: {missing}")` when the file does not exist."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot be read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: {invalid}: {exc}") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply") from None
