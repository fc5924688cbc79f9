"""kimi-k3-prune: keep N routed experts in every MoE layer of a kimi-k3 GGUF (REAP pruning).

    kimi-k3-prune IN.gguf OUT.gguf --saliency S.json (--keep-experts N | --keep-used) [--tag TAG]
                  [--rank reap|frequency]
    kimi-k3-prune IN.gguf OUT.gguf --plan PLAN.json
    [--overwrite] [--quiet]

Which experts: the N of highest REAP saliency per layer (gguf_arch/io/saliency.py; ties go to the
more often routed, then the lower id), from the whole calibration or one --tag of it; with
--rank frequency the N most often routed instead (bench/prune.py compares both on the fixtures);
--keep-used takes N = the most experts any layer routed to, so every expert the calibration
reached survives. --plan names them: {"layers": {"<layer>": [ids, ...]}}, one list per MoE layer.

One N for all layers: llama.cpp reads `expert_count` as one number and sizes every layer's
router and experts by it (the graph loader here too), so per-layer counts are not expressible
in a GGUF either runtime loads; a plan must give every layer the same number of ids.

The output: kept experts in ascending original id, each copied bit for bit (the three expert
tensors with their MXFP4 scales, whatever their type, the router's row and bias entry: each a
contiguous run of bytes); every other tensor (shared experts included) byte for byte;
expert_count = N, expert_used_count = min(k, N), the pruning keys (gguf_arch/arch/pruned.py), and an
integrity manifest `OUT.gguf.manifest.json` as the converter writes. Streamed in bounded chunks
(plain reads, never the whole model in memory); a split IN is read part by part, OUT is one file.
With the renormalised sigmoid router, a token whose selected experts all survive is routed
exactly as before; the others choose among the survivors.

Exit codes: 0 written; 1 runtime failure (OUT exists without --overwrite, I/O error);
2 bad input (GGUF, saliency file, plan, option); 130 interrupted (no partial output is left).
"""
from __future__ import annotations

from gguf_arch.errors.signals import install

install()  # first: a stop signal during the imports below is the documented line and code

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from gguf_arch.arch import keys as K
from gguf_arch.arch.config import K3Config
from gguf_arch.arch.keys import config_from_metadata
from gguf_arch.arch.pruned import Kept, is_per_expert, kept_keys, read_kept
from gguf_arch.arch.tensors import gguf_layer
from gguf_arch.errors import GGUFError, KimiError, run_cli
from gguf_arch.io.console import ArgumentParser, output_file
from gguf_arch.io.output_paths import OutputPaths
from gguf_arch.io.gguf_file import open_gguf
from gguf_arch.io.gguf_writer import KV, GGUFLayout, OutputTensor, write_gguf
from gguf_arch.io.jsonfile import read_json
from gguf_arch.io.manifest import TensorHasher, write_manifest
from gguf_arch.io.saliency import LayerSaliency, read_saliency
from gguf_arch.io.split_names import part_paths

from ..weights.loader import check_tensors, read_metadata

READ_BYTES = 64 << 20  # one read of tensor bytes; the writer holds at most a few of them
_NOT_COPIED = ("GGUF.", "general.architecture", "general.alignment", "split.")  # the writer's own


class PlanError(KimiError):
    """A pruning plan or option is malformed or does not fit the GGUF (exit code 2)."""


# ---- which experts ---------------------------------------------------------------------------

def top_experts(stats: LayerSaliency, n: int) -> tuple[int, ...]:
    """The n experts of highest saliency (ties: higher count, then lower id), ascending."""
    ids = np.arange(len(stats.saliency))
    order = np.lexsort((ids, -stats.count, -stats.saliency))
    return tuple(sorted(int(e) for e in order[:n]))


def most_used(stats: dict[int, LayerSaliency]) -> int:
    """The most experts any layer routed a calibration token to."""
    return max(int((s.count > 0).sum()) for s in stats.values())


RANKS = ("reap", "frequency")


def ranked_by(stats: dict[int, LayerSaliency], rank: str) -> dict[int, LayerSaliency]:
    """The statistics as top_experts ranks them: REAP saliency, or the routing counts themselves."""
    if rank == "frequency":
        return {l: LayerSaliency(s.count, s.count.astype(np.float64)) for l, s in stats.items()}
    return stats


def plan_from_saliency(stats: dict[int, LayerSaliency], n: int) -> Kept:
    return {layer: top_experts(s, n) for layer, s in stats.items()}


def read_plan(path: Path, moe_layers: Sequence[int], n_expert: int) -> Kept:
    doc = read_json(path, PlanError, "no such plan file")
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, dict) or set(layers) != {str(l) for l in moe_layers}:
        raise PlanError(f"{path}: expected {{\"layers\": {{\"<layer>\": [expert ids]}}}} with every MoE layer "
                        f"{list(moe_layers)}")
    kept = {}
    for layer in moe_layers:
        ids = layers[str(layer)]
        if (not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
                or any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < n_expert for e in ids)):
            raise PlanError(f"{path}: layer {layer}: expected distinct expert ids in 0..{n_expert - 1}, got {ids!r}")
        kept[layer] = tuple(sorted(ids))
    sizes = {len(ids) for ids in kept.values()}
    if len(sizes) > 1:
        raise PlanError(f"{path}: layers keep {sorted(sizes)} experts; a GGUF has one expert_count for all layers, "
                        "so every layer must keep the same number")
    return kept


# ---- the source GGUF -------------------------------------------------------------------------

@dataclass
class SourceGGUF:
    """A validated kimi-k3 GGUF (single or split), its tensors in file order with their part."""

    path: Path
    parts: list[Path]
    readers: list
    meta: dict[str, Any]
    cfg: K3Config
    tensors: list[tuple[int, Any]]  # (part index, gguf ReaderTensor)
    pruning: tuple[int, Kept] | None  # (original expert count, kept ids) when IN is pruned already

    @classmethod
    def open(cls, path: Path) -> "SourceGGUF":
        first = open_gguf(path)
        parts = part_paths(path, first)
        readers = [first] + [open_gguf(p) for p in parts[1:]]
        meta = read_metadata(readers)
        cfg = config_from_metadata(meta, str(path))
        tensors = [(i, t) for i, r in enumerate(readers) for t in r.tensors]
        check_tensors(cfg, {t.name: t for _, t in tensors}, str(path))
        for i, t in tensors:
            if t.data_offset + t.n_bytes > readers[i].data.nbytes:
                raise GGUFError(f"{parts[i]}: tensor {t.name!r} runs past the end of the file (truncated)")
        return cls(path, parts, readers, meta, cfg, tensors,
                   read_kept(meta, cfg.moe_layers, cfg.num_experts, str(path)))

    def original_ids(self, local: Kept) -> tuple[int, Kept]:
        """`local` (ids of this file's experts) as ids of the checkpoint, with its expert count."""
        if self.pruning is None:
            return self.cfg.num_experts, local
        original, kept = self.pruning
        return original, {l: tuple(kept[l][e] for e in ids) for l, ids in local.items()}

    def kv(self) -> list[tuple[str, Any, Any, Any]]:
        fields = self.readers[0].fields
        out = []
        for key, value in self.meta.items():
            if key.startswith(_NOT_COPIED):
                continue
            types = fields[key].types
            out.append((key, value, types[0], types[1] if len(types) > 1 else None))
        return out


# ---- the pruned GGUF -------------------------------------------------------------------------

def pruned_layout(src: SourceGGUF, local: Kept) -> GGUFLayout:
    n = len(next(iter(local.values())))
    cfg = dataclasses.replace(src.cfg, num_experts=n, num_experts_used=min(src.cfg.num_experts_used, n))
    changed = {key: (value, vtype, sub) for key, value, vtype, sub in K.model_keys(cfg)}
    original, kept = src.original_ids(local)
    kv: list[KV] = [(key, *changed.get(key, (value, vtype, sub))) for key, value, vtype, sub in src.kv()
                    if key not in (K.PRUNED_EXPERT_COUNT, K.PRUNED_KEPT_EXPERTS)]
    kv += kept_keys(kept, original)
    tensors = []
    for _, t in src.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if is_per_expert(t.name, gguf_layer(t.name)):
            shape = (n, *shape[1:])
        tensors.append(OutputTensor(t.name, t.tensor_type, shape))
    return GGUFLayout(K.ARCH, tuple(kv), tuple(tensors))


def byte_ranges(t, n_expert: int, kept: Sequence[int] | None) -> list[tuple[int, int]]:
    """(offset, length) in the file of what OUT keeps of tensor t: all of it, or the kept experts'
    runs (the expert is the outermost ggml axis, so each is n_bytes / n_expert contiguous bytes)."""
    start, size = int(t.data_offset), int(t.n_bytes)
    if kept is None:
        return [(start, size)]
    run = size // n_expert
    return [(start + e * run, run) for e in kept]


def _read_chunks(fd: int, ranges: list[tuple[int, int]], where: str) -> Iterator[bytes]:
    for offset, length in ranges:
        while length:
            block = os.pread(fd, min(length, READ_BYTES), offset)
            if not block:
                raise GGUFError(f"{where}: ends before byte {offset} (truncated while pruning)")
            yield block
            offset += len(block)
            length -= len(block)


def prune_gguf(src: SourceGGUF, out: Path, local: Kept, *, overwrite: bool = False, progress_bar: bool = False) -> None:
    """Write OUT from `src`, keeping experts `local` (ids of src's experts) per MoE layer."""
    layout = pruned_layout(src, local)
    where = {t.name: (i, t) for i, t in src.tensors}
    fds = [os.open(p, os.O_RDONLY) for p in src.parts]
    hasher = TensorHasher()

    def chunks_for(t: OutputTensor) -> Iterator[bytes]:
        i, rt = where[t.name]
        layer = gguf_layer(t.name)
        kept = local[layer] if is_per_expert(t.name, layer) else None
        return _read_chunks(fds[i], byte_ranges(rt, src.cfg.num_experts, kept), str(src.parts[i]))

    bar = tqdm(total=sum(t.nbytes for t in layout.tensors), desc=out.name, unit="B", unit_scale=True,
               unit_divisor=1024, file=sys.stderr, disable=not progress_bar, dynamic_ncols=True)

    def counted(t: OutputTensor) -> Iterator[bytes]:
        for chunk in hasher.wrap(chunks_for)(t):
            bar.update(len(chunk))
            yield chunk
    try:
        write_gguf(out, layout, counted, overwrite)
        write_manifest(out, hasher.digests)
    finally:
        hasher.close()
        bar.close()
        for fd in fds:
            os.close(fd)


# ---- command line ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-prune", description=__doc__.split("\n\n")[0])
    p.add_argument("input", type=Path, metavar="IN.gguf")
    p.add_argument("output", type=output_file, metavar="OUT.gguf")
    p.add_argument("--saliency", type=Path, metavar="S.json", help="kimi-k3-calibrate's saliency file")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--keep-experts", type=int, metavar="N", help="keep the N most salient experts per layer")
    how.add_argument("--keep-used", action="store_true", help="keep every expert the calibration routed to")
    how.add_argument("--plan", type=Path, metavar="PLAN.json", help="the experts to keep, per layer")
    p.add_argument("--tag", help="rank by this tag's saliency instead of the whole calibration's")
    p.add_argument("--rank", choices=RANKS, default="reap", help="REAP saliency (default) or routing frequency")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _choose(a: argparse.Namespace, src: SourceGGUF) -> Kept:
    cfg = src.cfg
    if a.plan is not None:
        if a.saliency is not None or a.tag is not None:
            raise PlanError("kimi-k3-prune: --plan names the experts itself; give it without --saliency/--tag")
        return read_plan(a.plan, cfg.moe_layers, cfg.num_experts)
    if a.saliency is None:
        raise PlanError("kimi-k3-prune: --keep-experts/--keep-used rank experts by --saliency S.json")
    stats = ranked_by(read_saliency(a.saliency, cfg.moe_layers, cfg.num_experts).scores(a.tag), a.rank)
    n = most_used(stats) if a.keep_used else a.keep_experts
    if not 1 <= n <= cfg.num_experts:
        raise PlanError(f"kimi-k3-prune: --keep-experts must be in 1..{cfg.num_experts} (the GGUF's expert_count), "
                        f"got {n}")
    return plan_from_saliency(stats, n)


def run(a: argparse.Namespace) -> None:
    reads = [(a.input, "IN.gguf")] + ([(a.saliency, "the saliency file")] if a.saliency else []) + \
        ([(a.plan, "the plan (--plan)")] if a.plan else [])
    guard = OutputPaths(read_files=reads, resumable=False)
    guard.add_gguf(a.output, "the pruned GGUF", replace=a.overwrite)
    guard.check()
    src = SourceGGUF.open(a.input)
    local = _choose(a, src)
    n = len(next(iter(local.values())))
    prune_gguf(src, a.output, local, overwrite=a.overwrite, progress_bar=not a.quiet and sys.stderr.isatty())
    print(f"kimi-k3-prune: wrote {a.output}: {n} of {src.cfg.num_experts} experts in each of "
          f"{len(local)} MoE layers, {min(n, src.cfg.num_experts_used)} used per token", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
