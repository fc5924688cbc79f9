"""Synthetic Kimi K3 / K3.1-Pro checkpoints in the real on-disk format: `kimi-k3-synth OUT_DIR`.

The output has what a released checkpoint has: the multimodal wrapper `config.json`, one shard
per decoder layer then one for the text globals, one for the projector and one for the vision
tower (named `model-{i:05d}-of-{n:06d}.safetensors`, metadata {"format": "pt"}),
`model.safetensors.index.json`, `tiktoken.model` and `tokenizer_config.json`. Text tensors carry
the `language_model.` prefix; `vision_tower.*` / `mm_projector.*` (no prefix) are the vision
table's sources (`arch.mmproj`), for an mmproj or for a text conversion to skip.

The text tensors, their names and shapes come from the tensor table (`arch.tensors.plan_tensors`)
for the config parsed back with `arch.config.parse_config`, so the generator cannot drift from what the
converter expects. Shards are streamed one tensor (one expert) at a time: memory stays flat
at any size. Same arguments, byte-identical files.
"""
from __future__ import annotations

from ..errors.signals import install

install()  # first: a stop signal during the imports below is the documented line and code

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..arch.config import K3Config, parse_config
from ..arch.mmproj import plan_vision_tensors
from ..arch.tensors import plan_tensors
from ..arch.vision import PUBLISHED_MEDIA, parse_vision_config
from ..errors import OutputError, run_cli
from ..io.console import ArgumentParser, human_size
from ..io.output_paths import create
from ..io.safetensors import INDEX_FILE
from ..io.safetensors_write import StreamedTensor, write_safetensors
from .config import DIMENSIONS, PRESETS, VARIANTS, build_config
from .tokenizer import ranks_for_vocab, write_tokenizer
from .weights import Init, default_init, init_for, tensor_chunks

SHARD_METADATA = {"format": "pt"}


def shard_name(index: int, count: int) -> str:
    """The released checkpoint's shard naming: 5-digit index, 6-digit count."""
    return f"model-{index:05d}-of-{count:06d}.safetensors"


@dataclass(frozen=True)
class Shard:
    filename: str
    tensors: tuple[StreamedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class CheckpointPlan:
    config: dict
    cfg: K3Config
    shards: tuple[Shard, ...]
    ranks: tuple[bytes, ...]  # tokenizer BPE ranks

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for s in self.shards)


def _streamed(seed: int, name: str, shape: tuple[int, ...], init: Init, cfg: K3Config) -> StreamedTensor:
    return StreamedTensor(name, init.dtype, shape, lambda: tensor_chunks(seed, name, shape, init, cfg))


def _text_tensors(cfg: K3Config, seed: int) -> Iterator[tuple[int | None, StreamedTensor]]:
    """(layer or None for globals, tensor) for every source of the table, each once."""
    seen: set[str] = set()
    for planned in plan_tensors(cfg):
        spec = planned.spec
        if spec.optional:  # an optional source is absent in the released checkpoint
            continue
        for i, (name, shape) in enumerate(planned.sources):
            if name not in seen:  # kv_b_proj feeds two GGUF tensors
                seen.add(name)
                init = init_for(spec, i % len(spec.sources), shape)
                yield planned.layer, _streamed(seed, name, shape, init, cfg)


def plan_checkpoint(dims: dict[str, int], variant: str, seed: int) -> CheckpointPlan:
    """Config, shard layout and tokenizer ranks for `dims` (every DIMENSIONS key); no weights drawn."""
    config = build_config(dims, variant)
    cfg = parse_config(config, "synthetic config")
    n = cfg.num_layers
    groups: list[list[StreamedTensor]] = [[] for _ in range(n + 3)]
    for layer, tensor in _text_tensors(cfg, seed):
        groups[n if layer is None else layer].append(tensor)
    vision = parse_vision_config(config, PUBLISHED_MEDIA, "synthetic config")
    for name, shape in sorted(src for pt in plan_vision_tensors(vision) for src in pt.sources):
        group = groups[n + 1] if name.startswith("mm_projector.") else groups[n + 2]
        group.append(_streamed(seed, name, shape, default_init(shape), cfg))
    shards = tuple(Shard(shard_name(i + 1, len(groups)), tuple(g)) for i, g in enumerate(groups))
    return CheckpointPlan(config, cfg, shards, ranks_for_vocab(cfg.vocab_size))


def _prepare_dir(out_dir: Path, keep: set[str], overwrite: bool) -> None:
    """Create out_dir; an existing non-empty one only with overwrite, dropping stale shards."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()) and not overwrite:
        raise OutputError(f"{out_dir}: directory is not empty (pass --overwrite to replace a generated checkpoint)")
    for old in out_dir.glob("model-*-of-*.safetensors"):
        if old.name not in keep:
            old.unlink()


def _dump(path: Path, obj: dict, sort_keys: bool) -> None:
    # No trailing newline, 2-space indent: as the released files. Never through a link in the directory.
    with create(path, replace=True, mode="w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=sort_keys))


def write_checkpoint(plan: CheckpointPlan, out_dir: Path, overwrite: bool = False) -> None:
    """Write every file of `plan` into out_dir, streaming the shards."""
    _prepare_dir(out_dir, {s.filename for s in plan.shards}, overwrite)
    weight_map = {}
    for shard in plan.shards:
        path = out_dir / shard.filename
        try:
            write_safetensors(path, shard.tensors, SHARD_METADATA)
        except OSError as exc:  # a full disk names the shard, not only its errno
            raise OutputError(f"writing {path} failed: {exc.strerror or exc}") from None
        weight_map.update((t.name, shard.filename) for t in shard.tensors)
    index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _dump(out_dir / INDEX_FILE, index, sort_keys=False)
    _dump(out_dir / "config.json", plan.config, sort_keys=True)
    write_tokenizer(out_dir, plan.ranks, plan.cfg.context_length)


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="kimi-k3-synth",
        description="Write a seeded random Kimi K3 / K3.1-Pro checkpoint in the released on-disk format.")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR",
                   help="directory to write the checkpoint into (created; must be empty unless --overwrite)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="tiny: the shared fixtures' sizes (~2 MB); large: real hidden and expert sizes, "
                        "4 layers, 64 experts (~9 GB)")
    p.add_argument("--variant", choices=VARIANTS, default="k31pro",
                   help="k31pro adds the DSA index_* fields and indexer tensors (default)")
    p.add_argument("--seed", type=_non_negative, default=0, metavar="N",
                   help="seed of every weight (default 0): the same seed and dimensions give byte-identical files")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in OUT_DIR")
    p.add_argument("--dry-run", action="store_true", help="print the shard plan, write nothing")
    dims = p.add_argument_group("dimensions (override the preset)")
    for key, (section, field) in DIMENSIONS.items():
        dims.add_argument(f"--{key}", type=_non_negative, metavar="N",
                          help=f"{field} (k31pro only)" if section == "index" else field)
    return p


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _report(plan: CheckpointPlan, out_dir: Path, dry_run: bool) -> None:
    n_tensors = sum(len(s.tensors) for s in plan.shards)
    if dry_run:
        for s in plan.shards:
            print(f"{s.filename}  {len(s.tensors):6d} tensors  {s.nbytes:15,d} bytes")
    verb = "would write" if dry_run else "wrote"
    print(f"{verb} {len(plan.shards)} shards, {n_tensors} tensors, {plan.total_size:,} bytes ({human_size(plan.total_size)}) "
          f"of tensors to {out_dir}")


def _run(argv: list[str] | None) -> None:
    args = _parser().parse_args(argv)
    dims = {key: getattr(args, key.replace("-", "_")) for key in DIMENSIONS}
    dims = {key: PRESETS[args.preset][key] if value is None else value for key, value in dims.items()}
    plan = plan_checkpoint(dims, args.variant, args.seed)
    if not args.dry_run:
        write_checkpoint(plan, args.out_dir, args.overwrite)
    _report(plan, args.out_dir, args.dry_run)


def main(argv: list[str] | None = None) -> int:
    # Parsing runs inside run_cli: a bad argument is the one-line error of every console script.
    return run_cli(lambda: _run(argv))


if __name__ == "__main__":
    sys.exit(main())
