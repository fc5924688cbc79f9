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
from ..io.console import cpu_count, task_bar
from ..io.jsonfile import NotRegularFile, open_regular
from ..io.manifest import IntegrityError, Manifest, check_hashes, read_manifest
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


def verify(gguf: Path | str, model_dir: Path | str, log: Callable[[str], None] = print, bar: bool = False) -> None:
    """Stored digests first, then every tensor recomputed from the checkpoint; raise at the first difference.

    A split conversion is verified from its first part: every part against its own manifest, then
    all parts' tensors against the checkpoint, read together as the tensor diff reads a split.
    `bar`: a progress bar on stderr for each of the two steps.
    """
    # The converter's strict reader vets the index (no shard name outside MODEL_DIR) and every
    # header before the diff's own reader opens a shard.
    open_checkpoint(model_dir).close()
    gguf = Path(gguf)
    _need_file(gguf, "expected the converted GGUF file")
    manifests = _checked_manifests(gguf, bar)
    intended = {d.name: d.ggml_type for m in manifests.values() for d in m.tensors}
    log(f"{gguf}: {len(intended)} tensor digests match the manifest(s) of {len(manifests)} file(s)")
    n = 0
    with task_bar(f"comparing with {Path(model_dir).name}", len(intended), enabled=bar) as progress:
        for diff in iter_tensor_diffs(model_dir, gguf, intended_types=intended):  # every part, as the diff reads them
            progress.update()
            if not diff.ok:
                raise IntegrityError(f"{gguf}: differs from {model_dir}: {diff.line()}")
            n += 1
    log(f"{gguf}: all {n} tensors match {model_dir}")


def _checked_manifests(gguf: Path, bar: bool) -> dict[Path, Manifest]:
    """Every part's manifest, each part hashed against its own (the first before anything parses it)."""
    manifests = {gguf: read_manifest(gguf)}
    with task_bar("checking digests", manifests[gguf].gguf_size, enabled=bar, in_bytes=True) as progress:
        check_hashes(gguf, manifests[gguf], progress.update, cpu_count())
        for part in part_paths(gguf, open_gguf(gguf))[1:]:
            _need_file(part, f"a part of the split {gguf}")
            manifests[part] = read_manifest(part)
            progress.total += manifests[part].gguf_size
            check_hashes(part, manifests[part], progress.update, cpu_count())
    return manifests
