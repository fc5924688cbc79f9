"""Split output: one GGUF layout -> the parts `OUT-00001-of-0000N.gguf` llama.cpp loads and merges.

The rules are llama.cpp's (tools/gguf-split, src/llama-model-loader.cpp, gguf-py's GGUFWriter):
- the first part carries every key; each later part carries only the split keys;
- every part ends its keys with split.no (uint16, 0-based), split.count (uint16) and
  split.tensors.count (int32, the tensors of all parts together);
- tensors keep their order; a new part starts when the current one holds --split-max-tensors
  tensors, or when the next tensor's aligned bytes would take it over --split-max-size (a part
  always takes at least one tensor, so a tensor larger than the limit gets a part of its own);
- when the limits give a single part, the output is one plain file at OUT without split keys,
  as gguf-py writes it.
`llama-gguf-split --merge` copies the first part's keys (with split.count set to 0) and appends
every part's tensors; the model loader opens the parts from the first one's name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType as T
from gguf.constants import Keys

from ..errors import KimiError
from .gguf_writer import GGUFLayout, OutputTensor, padded
from .split_names import part_path

SPLIT_KEYS = (Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
# llama.cpp's split_str_to_n_bytes: decimal units, as in --split-max-size 50G.
_UNITS = {"": 1, "K": 1000, "M": 1000 ** 2, "G": 1000 ** 3}
# split.no and split.count are uint16.
MAX_PARTS = 0xFFFF


@dataclass(frozen=True)
class SplitLimits:
    max_bytes: int = 0  # 0: no size limit
    max_tensors: int = 0  # 0: no tensor-count limit

    @property
    def splits(self) -> bool:
        """Whether any limit is set (the output may then be parts, named as parts)."""
        return bool(self.max_bytes or self.max_tensors)


def parse_size(text: str) -> int:
    """`--split-max-size` value: a positive integer, optionally followed by K, M or G (powers of 1000)."""
    m = re.fullmatch(r"([0-9]+)([KMG]?)", text.strip())
    if not m or int(m.group(1)) == 0:
        raise KimiError(f"--split-max-size {text!r}: expected a positive number of bytes, optionally followed by "
                        "K, M or G (powers of 1000, as llama.cpp reads it), e.g. 50G")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _groups(tensors: tuple[OutputTensor, ...], limits: SplitLimits) -> list[list[OutputTensor]]:
    groups: list[list[OutputTensor]] = [[]]
    size = 0
    for t in tensors:
        cur = groups[-1]
        full = (limits.max_tensors and len(cur) >= limits.max_tensors) or \
               (limits.max_bytes and size + padded(t.nbytes) > limits.max_bytes)
        if cur and full:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += padded(t.nbytes)
    return groups


def _split_kv(no: int, count: int, n_tensors: int) -> tuple:
    values = ((no, T.UINT16), (count, T.UINT16), (n_tensors, T.INT32))
    return tuple((key, v, vtype, None) for key, (v, vtype) in zip(SPLIT_KEYS, values))


def split_layout(out: Path, layout: GGUFLayout, limits: SplitLimits) -> list[tuple[Path, GGUFLayout]]:
    """(path, layout) of every output file, in order; [(out, layout)] when nothing needs splitting."""
    groups = _groups(layout.tensors, limits)
    if len(groups) == 1:
        return [(out, layout)]
    if len(groups) > MAX_PARTS:
        raise KimiError(f"the split limits give {len(groups)} files; split.count holds at most {MAX_PARTS}: "
                        "raise --split-max-size or --split-max-tensors")
    n, total = len(groups), len(layout.tensors)
    first = GGUFLayout(layout.arch, (*layout.kv, *_split_kv(0, n, total)), tuple(groups[0]))
    rest = [GGUFLayout(None, _split_kv(i, n, total), tuple(g)) for i, g in enumerate(groups[1:], 1)]
    return [(part_path(out, i + 1, n), part) for i, part in enumerate([first, *rest])]
