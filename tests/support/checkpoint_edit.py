"""Test helper: read and rewrite safetensors shards byte by byte, independently of gguf_arch.

Used to build bad checkpoints from a copy of a fixture and to read source bytes for comparisons.
safetensors' own numpy writer cannot hold bf16, so shards are (re)written here.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

INDEX = "model.safetensors.index.json"
RAW_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "U8": "u1"}


def read_shard(path: Path) -> tuple[dict, dict[str, tuple[str, list[int], bytes]]]:
    """(metadata, name -> (dtype, shape, bytes)) in header order."""
    blob = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    return meta, {name: (h["dtype"], h["shape"], blob[base + h["data_offsets"][0]:base + h["data_offsets"][1]])
                  for name, h in header.items()}


def write_shard(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], meta: dict | None = None) -> None:
    header: dict = {"__metadata__": meta or {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    hbytes = json.dumps(header).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)) + hbytes)
        for _, _, data in tensors.values():
            f.write(data)


def source_array(model_dir: Path, name: str) -> tuple[str, np.ndarray]:
    """(dtype, raw numpy array) of one tensor, bf16 as uint16."""
    shard = json.loads((Path(model_dir) / INDEX).read_text())["weight_map"][name]
    dtype, shape, data = read_shard(Path(model_dir) / shard)[1][name]
    return dtype, np.frombuffer(data, dtype=RAW_DTYPES[dtype]).reshape(shape)


def as_f32(dtype: str, a: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


class EditableCheckpoint:
    """A copy of a fixture that tests may break in one place."""

    def __init__(self, src: Path, dst: Path):
        shutil.copytree(src, dst)
        self.dir = dst

    @property
    def index(self) -> dict:
        return json.loads((self.dir / INDEX).read_text())

    def edit_weight_map(self, fn) -> None:
        """Let `fn` change the index's weight_map in place, then write the index back."""
        index = self.index
        fn(index["weight_map"])
        (self.dir / INDEX).write_text(json.dumps(index, indent=2))

    def shard_of(self, name: str) -> Path:
        return self.dir / self.index["weight_map"][name]

    def edit_shard(self, shard: Path, fn) -> None:
        meta, tensors = read_shard(shard)
        fn(tensors)
        write_shard(shard, tensors, meta)

    def drop(self, name: str) -> None:
        shard = self.shard_of(name)
        self.edit_shard(shard, lambda t: t.pop(name))
        self.edit_weight_map(lambda wmap: wmap.pop(name))

    def add(self, name: str, dtype: str, shape: list[int], data: bytes, shard_name: str) -> None:
        def put(t):
            t[name] = (dtype, shape, data)
        self.edit_shard(self.dir / shard_name, put)
        self.edit_weight_map(lambda wmap: wmap.update({name: shard_name}))

    def replace(self, name: str, dtype: str, shape: list[int], data: bytes) -> None:
        def put(t):
            t[name] = (dtype, shape, data)
        self.edit_shard(self.shard_of(name), put)

    def rename(self, old: str, new: str) -> None:
        shard = self.shard_of(old)
        self.edit_shard(shard, lambda t: t.__setitem__(new, t.pop(old)))
        self.edit_weight_map(lambda wmap: wmap.update({new: wmap.pop(old)}))

    def edit_config(self, fn) -> None:
        path = self.dir / "config.json"
        cfg = json.loads(path.read_text())
        fn(cfg)
        path.write_text(json.dumps(cfg, indent=2))
