"""A loaded model's identity: what a saved sequence state must come from to be restored.

SHA-256 over the metadata the model runs with (after --override-kv: an override changes what the
caches hold), every tensor's name, type and shape, and the first and last IDENTITY_SAMPLE bytes of
each tensor's data. Two GGUFs of one architecture and size but other weights differ in those
bytes; hashing every byte would read the whole model (1.56 TB for the real one) to save a chat.
The sample reads 2 x 4 KiB per tensor (about 16 MB for the real model's ~2,000 tensors).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from .loader import GGUFWeights

IDENTITY_SAMPLE = 4096


def _canonical(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def model_identity(weights: GGUFWeights) -> str:
    h = hashlib.sha256()
    meta = {k: _canonical(v) for k, v in sorted(weights.metadata.items())}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for reader in weights.readers:
        for t in reader.tensors:
            h.update(f"{t.name}|{int(t.tensor_type)}|{list(map(int, t.shape))}|".encode())
            raw = t.data.reshape(-1).view("u1")
            h.update(raw[:IDENTITY_SAMPLE].tobytes())
            h.update(raw[-IDENTITY_SAMPLE:].tobytes())
    return h.hexdigest()
