"""`convert_kimi_k3.py --verify`: a converted GGUF against its manifest(s), then against the checkpoint.

The stored digests first (`io.manifest.check_hashes`: cheap, catches bit rot and truncation),
then every tensor recomputed from the HF source with the tensor diff (`diff.py`, independent of
the write path), stopping at the first difference.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..errors import GGUFError
from ..io.gguf_file import open_gguf
from ..io.jsonfile import NotRegularFile, open_regular
from ..io.manifest import IntegrityError, check_hashes, read_manifest
from ..io.safetensors import open_checkpoint
from ..io.split_names import part_paths
from .diff import iter_tensor_diffs


def _need_file(path: Path, what: str) -> None:
    """A regular file at `path` (a FIFO is refused, never opened blocking)."""
    try:
        os.close(open_regular(path))
    except FileNotFoundError:
        raise GGUFError(f"{path}: not found ({what})") from None
    except NotRegularFile as exc:
        raise GGUFError(f"{path}: {exc}") from None
    except OSError as exc:
        raise GGUFError(f"{path}: cannot be read: {exc.strerror}") from None


def verify(gguf: Path | str, model_dir: Path | str, log: Callable[[str], None] = print) -> None:
    """Stored digests first, then every tensor recomputed from the checkpoint; raise at the first difference.

    A split conversion is verified from its first part: every part against its own manifest, then
    all parts' tensors against the checkpoint, read together as the tensor diff reads a split.
    """
    # The converter's strict reader vets the index (no shard name outside MODEL_DIR) and every
    # header before the diff's own reader opens a shard.
    open_checkpoint(model_dir).close()
    gguf = Path(gguf)
    _need_file(gguf, "expected the converted GGUF file")
    manifests = {gguf: read_manifest(gguf)}
    check_hashes(gguf, manifests[gguf])  # before anything else parses the file
    for part in part_paths(gguf, open_gguf(gguf))[1:]:
        _need_file(part, f"a part of the split {gguf}")
        manifests[part] = read_manifest(part)
        check_hashes(part, manifests[part])
    intended = {d.name: d.ggml_type for m in manifests.values() for d in m.tensors}
    log(f"{gguf}: {len(intended)} tensor digests match the manifest(s) of {len(manifests)} file(s)")
    n = 0
    for diff in iter_tensor_diffs(model_dir, gguf, intended_types=intended):  # every part, as the diff reads them
        if not diff.ok:
            raise IntegrityError(f"{gguf}: differs from {model_dir}: {diff.line()}")
        n += 1
    log(f"{gguf}: all {n} tensors match {model_dir}")
