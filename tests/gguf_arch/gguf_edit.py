"""Test helper: deliberately damaged copies of a converted GGUF.

`edited_copy` changes a tensor's bytes in place at its data offset (same size, same header);
`rewritten_copy` writes the tensors again with gguf-py's writer, so a tensor can change type or
disappear and extra tensors can be added. The rewrite carries no KV metadata: the tensor diff
reads tensors only.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFWriter


def tensor_info(path: Path, name: str):
    return next(t for t in GGUFReader(path).tensors if t.name == name)


def edited_copy(src: Path, dst: Path, name: str, edit: Callable[[np.ndarray], None]) -> Path:
    """Copy src to dst and let `edit` change the tensor's bytes (a writable uint8 view) in place."""
    shutil.copyfile(src, dst)
    reader = GGUFReader(dst, "r+")
    t = next(t for t in reader.tensors if t.name == name)
    edit(reader.data[t.data_offset: t.data_offset + t.n_bytes])
    reader.data.flush()
    return dst


def rewritten_copy(src: Path, dst: Path, replace: dict[str, tuple[np.ndarray, Q] | None] | None = None,
                   extra: dict[str, np.ndarray] | None = None) -> Path:
    """Rewrite src's tensors into dst; `replace` maps a name to (data, type) or None (drop it).

    Data of a block type (BF16, Q8_0, MXFP4) is uint8 in gguf-py's byte shape, as GGUFReader
    and gguf.quants.quantize give it; F32/F16 data is the plain array.
    """
    replace, extra = replace or {}, extra or {}
    writer = GGUFWriter(dst, "kimi-k3")
    for t in GGUFReader(src).tensors:
        if t.name not in replace:
            data, qtype = t.data, t.tensor_type
        elif replace[t.name] is None:
            continue
        else:
            data, qtype = replace[t.name]
        writer.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=qtype)
    for name, data in extra.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
