"""The names of a split GGUF's parts: how the writer names them and how every reader (the
runner's loader, --verify, the tensor diff) finds them from the first. Apart from the writer's
split layout (`split.py`), so a reader never imports the write path.

gguf-py's SHARD_NAME_FORMAT and llama.cpp's llama_split_path: `OUT-00001-of-0000N.gguf`.
"""
from __future__ import annotations

import re
from pathlib import Path

from gguf import GGUFReader
from gguf.constants import Keys

from ..errors import GGUFError

PART_NAME = "{stem}-{no:05d}-of-{count:05d}.gguf"
_PART = re.compile(r"(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def part_path(out: Path, no: int, count: int) -> Path:
    """The file name of part `no` (1-based) of `count`, next to `out`."""
    return out.with_name(PART_NAME.format(stem=out.stem, no=no, count=count))


def part_paths(first: Path, reader: GGUFReader) -> list[Path]:
    """The files of a GGUF given its first file: every part of a split (by PART_NAME), or [first].

    split.count absent, 1, or 0 (as `llama-gguf-split --merge` leaves it) is a single file, as for
    llama.cpp's loader; any other count needs `first` to be named as part 1 of that many.
    """
    field = reader.fields.get(Keys.Split.LLM_KV_SPLIT_COUNT)
    count = field.contents() if field is not None else 1
    if count in (0, 1):
        return [first]
    m = _PART.fullmatch(first.name)
    if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
        raise GGUFError(f"{first}: part of a {count}-part split ({Keys.Split.LLM_KV_SPLIT_COUNT} {count}); give the "
                        f"first part, '<name>-00001-of-{count:05d}.gguf'")
    out = first.with_name(m["stem"] + ".gguf")
    return [part_path(out, no, count) for no in range(1, count + 1)]
