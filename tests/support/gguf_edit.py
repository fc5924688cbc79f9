"""Test helper: deliberately damaged copies of a converted GGUF.

`edited_copy` changes a tensor's bytes in place at its data offset (same size, same header);
`rewritten_copy` writes the file again with gguf-py's writer, so a tensor can change type or
disappear, extra tensors can be added, and metadata keys can be changed or dropped.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter


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
                   extra: dict[str, np.ndarray] | None = None, *,
                   keys: dict[str, tuple | None] | None = None, split_max_tensors: int = 0) -> Path:
    """Rewrite src into dst with gguf-py's writer, keeping everything not changed.

    `replace` maps a tensor name to (data, type) or None (drop it); `extra` adds tensors; `keys`
    maps a metadata key to None (drop it) or (value, type[, array element type]);
    `split_max_tensors` writes llama.cpp-style split parts. Data of a block type (BF16, Q8_0,
    MXFP4) is uint8 in gguf-py's byte shape, as GGUFReader and gguf.quants.quantize give it;
    F32/F16 data is the plain array.
    """
    replace, extra, keys = replace or {}, extra or {}, keys or {}
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, str(reader.fields["general.architecture"].contents()),
                        split_max_tensors=split_max_tensors)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in keys:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub)
    for name, change in keys.items():
        if change is not None:
            writer.add_key_value(name, change[0], change[1], change[2] if len(change) > 2 else None)
    for t in reader.tensors:
        change = replace.get(t.name, (t.data, t.tensor_type))
        if change is not None:
            writer.add_tensor(t.name, np.ascontiguousarray(change[0]), raw_dtype=change[1])
    for name, data in extra.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
