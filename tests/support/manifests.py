"""Manifests as the converter wrote them before BLAKE3 (format kimi-k3-gguf-sha256/1, named
`<file>.sha256.json`), made here from a GGUF's bytes with hashlib and gguf-py alone: what the
readers must keep accepting, built without the code under test."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from gguf import GGUFReader


def write_legacy_manifest(gguf: Path) -> Path:
    """`<gguf>.sha256.json` for the file as it is now; returns its path."""
    reader = GGUFReader(gguf)
    start = min(int(t.data_offset) for t in reader.tensors)
    doc = {"format": "kimi-k3-gguf-sha256/1", "gguf": gguf.name, "gguf_size": gguf.stat().st_size,
           "header_sha256": hashlib.sha256(gguf.read_bytes()[:start]).hexdigest(),
           "tensors": [[t.name, t.tensor_type.name, int(t.n_bytes), hashlib.sha256(t.data.tobytes()).hexdigest()]
                       for t in reader.tensors]}
    path = gguf.with_name(gguf.name + ".sha256.json")
    path.write_text(json.dumps(doc, indent=0))
    return path
