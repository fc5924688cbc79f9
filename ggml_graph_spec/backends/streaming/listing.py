"""A model's layout for kimi-k3-doctor: from a GGUF, or from the converter's saved --dry-run
listing (`convert_kimi_k3.py CKPT OUT --dry-run > plan.txt`), so that a machine can be sized for
the real model before its 1.5 TB are converted. Both give the same figures the runner's plan
reads (trunk bytes per layer, the bytes outside the layers, the experts): the listing's tensor
lines hold every tensor's GGUF name and bytes, its key lines the expert counts."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf_arch.arch.keys import ARCH_KEYS, DRY_RUN_HEADER, MOE_LISTED
from gguf_arch.arch.tensors import gguf_kind, gguf_layer
from gguf_arch.errors import GGUFError
from gguf_arch.io.jsonfile import open_regular, read_text

from ...weights.loader import load_gguf
from .budget import ExpertSizes
from .experts import pitches
from .layer_files import EXPERT_KINDS, LayerFiles, slot_align

_MOE_KEYS = {k.full_name: k.name for k in ARCH_KEYS if k.name in MOE_LISTED}


@dataclass(frozen=True)
class ModelLayout:
    """What --mem-budget plans with, and where the model is (or is to be) on disk."""

    layers: list[int]  # trunk bytes of each layer (every tensor but the routed experts)
    outside: int  # bytes of the tensors no layer owns (embedding, head)
    experts: int  # bytes of all routed experts
    sizes: ExpertSizes | None
    paths: list[str]  # the GGUF's files (a listing's: as planned, maybe not there yet)
    planned: bool  # from a dry-run listing

    @property
    def trunk(self) -> int:
        """Bytes of every tensor but the routed experts."""
        return sum(self.layers) + self.outside

    @property
    def total(self) -> int:
        return self.trunk + self.experts


def is_listing(path: Path) -> bool:
    """A saved dry run: a text file whose first line is the converter's header."""
    try:  # never a plain open(): a FIFO given as MODEL would block it forever
        with open(open_regular(path), "rb") as f:
            return f.read(len(DRY_RUN_HEADER)) == DRY_RUN_HEADER.encode()
    except OSError:
        return False  # the GGUF loader names what it is


def gguf_layout(path: Path) -> ModelLayout:
    weights = load_gguf(path, repack=False)
    try:
        files = LayerFiles(weights)
        try:
            return ModelLayout(files.layer_bytes(), files.outside, files.expert_bytes(),
                               files.expert_sizes(weights.cfg.num_experts_used, pitched=True),
                               [p for p, _, _ in weights.mapped_files], planned=False)
        finally:
            files.close()
    finally:
        weights.close()


def listing_layout(path: Path) -> ModelLayout:
    """The layout from a dry-run listing (module docstring); a line it cannot read is an error."""
    trunks: dict[int, int] = {}
    exps: dict[int, dict[str, int]] = {}
    keys: dict[str, int] = {}
    outside, paths = 0, []
    for n, line in enumerate(read_text(path, GGUFError, "not found").splitlines(), 1):
        if line.startswith("file "):
            paths.append(line[5:].rsplit(": ", 1)[0])
        elif line.startswith("  "):
            name, nbytes = _tensor_line(path, n, line)
            layer, kind = gguf_layer(name), gguf_kind(name)
            if layer is None:
                outside += nbytes
            elif kind in EXPERT_KINDS:
                exps.setdefault(layer, {})[kind] = nbytes
            else:
                trunks[layer] = trunks.get(layer, 0) + slot_align(nbytes)
        elif line.split(" = ")[0] in _MOE_KEYS:
            keys[_MOE_KEYS[line.split(" = ")[0]]] = int(line.split(" = ")[1])
    return _from_listing(path, trunks, exps, keys, outside, paths)


def _tensor_line(path: Path, n: int, line: str) -> tuple[str, int]:
    parts = line.split()
    if len(parts) != 3 or not parts[2].isdigit():
        raise GGUFError(f"{path}:{n}: expected a dry-run tensor line 'NAME TYPE BYTES', got {line.strip()!r}")
    return parts[0], int(parts[2])


def _from_listing(path: Path, trunks: dict[int, int], exps: dict[int, dict[str, int]], keys: dict[str, int],
                  outside: int, paths: list[str]) -> ModelLayout:
    missing = [k for k in MOE_LISTED if k not in keys]
    if not paths or not trunks or missing:
        raise GGUFError(f"{path}: not a complete convert_kimi_k3.py --dry-run listing (no file line, no layer "
                        f"tensors, or no {', '.join(missing) or 'MoE key'} line); save the whole output")
    count, n_layers = keys["expert_count"], max([*trunks, *exps]) + 1
    bad = [l for l, kinds in exps.items() if set(kinds) != set(EXPERT_KINDS) or any(b % count for b in kinds.values())]
    if bad:
        raise GGUFError(f"{path}: layer {bad[0]}'s routed experts are not {len(EXPERT_KINDS)} stacks of "
                        f"{count} experts each")
    strides = {tuple(kinds[k] // count for k in EXPERT_KINDS) for kinds in exps.values()}
    sizes = None if len(strides) != 1 else ExpertSizes(
        tuple(count if l in exps else 0 for l in range(n_layers)),
        sum(pitches(list(next(iter(strides))), pitched=True)), keys["expert_used_count"])
    return ModelLayout([trunks.get(l, 0) for l in range(n_layers)], outside,
                       sum(b for kinds in exps.values() for b in kinds.values()), sizes, paths, planned=True)
