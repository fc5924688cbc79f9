"""Run a conversion: plan it (`plan.py`), lay out the files, then stream every tensor once.

Each output file is written whole (`.partial`, fsync, rename) and then its per-tensor SHA-256
manifest; with --resume, files an interrupted run finished and verified are kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..arch.config import load_config
from ..arch.keys import ARCH
from ..arch.transforms import tensor_chunks
from ..errors import Interrupted, KimiError
from ..errors.signals import deferred
from ..io.gguf_writer import KV, GGUFLayout, OutputTensor, write_gguf
from ..io.manifest import TensorHasher, write_manifest
from ..io.output_lock import lock_path, output_lock
from ..io.output_paths import OutputPaths, names_a_directory
from ..io.pipeline import Lookahead
from ..io.safetensors import open_checkpoint
from ..io.split import SplitLimits, split_layout
from ..io.split_names import part_path
from .finite import checked_chunks
from .plan import ConversionPlan, Ledger, gguf_metadata, plan_conversion, resolve_plan
from .preflight import check_free_space
from .progress import Progress
from .resume import OutputFile, files_to_write, left_behind
from quant_rules.apply import final_chunks, final_outputs
from quant_rules.options import write_quantize_rules
from quant_rules.rules import QuantOptions, Resolution


@dataclass(frozen=True)
class OutputOptions:
    """How the output is written: split limits, resume, progress reporting."""

    split: SplitLimits = SplitLimits()
    resume: bool = False  # keep verified finished files of an interrupted run, rewrite the rest
    progress_bar: bool = False  # a tqdm bar per file on stderr
    log_json: Path | None = None  # one JSON progress line per tensor
    export_rules: Path | None = None  # the llama-quantize rules for this conversion's types
    allow_non_finite: bool = False  # write NaN/inf values with a warning instead of refusing them
    threads: int = 1  # worker threads per stage (-j): experts repacked, shard reads in flight, scan

    @property
    def read_ahead(self) -> int:
        # 16 MiB per read in flight: capped so that memory stays a few chunks on a 64-core machine.
        return min(self.threads, MAX_READ_AHEAD)

    @property
    def repack_ahead(self) -> int:
        # ~6 MB per real expert in flight, twice (input and output): -j 1000 must not hold 1000.
        return min(self.threads, MAX_REPACK_AHEAD)


MAX_READ_AHEAD = 4
MAX_REPACK_AHEAD = 8


def claim_outputs(model_dir: Path, out: Path, files: list[OutputFile], todo: list[OutputFile] | None,
                  output: OutputOptions, replace: bool) -> OutputPaths:
    """Every file this run writes, for the guard; `todo` None: the part names are not planned yet,
    `files` then holds one name of the right length."""
    guard = OutputPaths([(model_dir, "the model directory")])
    to_write = {id(f) for f in todo or ()}
    for f in files:
        written = id(f) in to_write
        guard.add_gguf(f.path, "the GGUF" if len(files) == 1 else f"part {f.path.name}", replace=replace,
                       written=written or (todo is None and not output.split.splits))
    if output.log_json is not None:
        guard.add(output.log_json, "the JSON progress log (--log-json)", replace=replace)
    if output.export_rules is not None:
        guard.add(output.export_rules, "the llama-quantize rules (--export-quantize-rules)", replace=replace)
    guard.add(lock_path(out), "the output's lock file", replace=True, written=False)  # taken over, not replaced
    return guard


def conversion_layout(plan: ConversionPlan, kv: tuple[KV, ...], quant: QuantOptions,
                      log: Callable[[str], None]) -> tuple[GGUFLayout, Resolution]:
    """The whole output (before any split) with the final tensor types quant_rules picks."""
    # plan.outputs carry the contract types; quant_rules picks the final ones (and re-encodes).
    types = resolve_plan(plan.outputs, quant)
    for line in types.log:
        log(line)
    return GGUFLayout(ARCH, kv, final_outputs(types)), types


def output_files(out: Path, layout: GGUFLayout, split: SplitLimits) -> list[OutputFile]:
    return [OutputFile.planned(path, part) for path, part in split_layout(out, layout, split)]


def _first_name(out: Path, split: SplitLimits) -> OutputFile:
    """The output's one file, or a part name of the length every part name has (for the early check)."""
    empty = GGUFLayout(ARCH, (), ())
    return OutputFile(part_path(out, 1, 1) if split.splits else out, empty, 0)


def _write_files(files: list[OutputFile], source_chunks, progress: Progress, replace: bool, log,
                 done: list[OutputFile]) -> None:
    """Each file streamed, renamed into place, then its manifest; one file at a time."""
    for f in files:
        with TensorHasher() as hasher:
            chunks_for, close_bar = progress.track(f.path, f.layout, hasher.wrap(source_chunks))
            try:
                write_gguf(f.path, f.layout, chunks_for, replace)
            finally:
                close_bar()
            write_manifest(f.path, hasher.digests, replace)
        done.append(f)
        log(f"wrote {f.path}")


@dataclass(frozen=True)
class _Planned:
    plan: ConversionPlan
    types: Resolution
    files: list[OutputFile]
    todo: list[OutputFile]


def plan_files(cfg, ckpt, model_dir: Path, out: Path, dsa: bool, quant: QuantOptions, output: OutputOptions,
                log) -> _Planned:
    plan = plan_conversion(cfg, ckpt.metas, dsa=dsa)
    kv = tuple(gguf_metadata(plan.cfg, model_dir))  # reads the tokenizer: fails before any output
    log(plan.ledger.summary())
    if cfg.indexer is not None and not dsa:
        log("DSA disabled (--no-dsa): indexer keys and tensors left out, written as plain kimi-k3")
    layout, types = conversion_layout(plan, kv, quant, log)
    files = output_files(out, layout, output.split)
    return _Planned(plan, types, files, files_to_write(files, log) if output.resume else files)


def source_chunks_for(p: _Planned, ckpt, output: OutputOptions, log) -> Callable[[OutputTensor], Iterator]:
    """Each output tensor's final bytes, scanned for non-finite values (what the writer pulls)."""
    by_name = {o.output.name: o.tensor for o in p.plan.outputs}
    decided = {d.name: d for d in p.types.decisions}

    def source_chunks(t: OutputTensor) -> Iterator:
        d, pt = decided[t.name], by_name[t.name]
        chunks = final_chunks(d, tensor_chunks(pt, d.contract_type, ckpt.read, output.repack_ahead), log)
        return checked_chunks(t, pt.sources[0][0], chunks, output.allow_non_finite, output.threads)
    return source_chunks


def _write_all(p: _Planned, ckpt, output: OutputOptions, replace: bool, log) -> None:
    # The next tensor's reads start while the current one's last chunks are scanned, hashed and
    # written: without it the disk idles at each of the ~2,000 tensor boundaries of the real model.
    order = [t for f in p.todo for t in f.layout.tensors] if output.threads > 1 else []  # -j 1: inline
    source_chunks = Lookahead(source_chunks_for(p, ckpt, output, log), order)
    progress = Progress(sum(t.nbytes for f in p.todo for t in f.layout.tensors), bar=output.progress_bar,
                        log_json=output.log_json, replace=replace)
    done: list[OutputFile] = []
    try:
        with deferred():  # a stop signal waits for the next chunk or file (signals.deferred)
            _write_files(p.todo, source_chunks, progress, replace, log, done)
    except KeyboardInterrupt as exc:  # Interrupted too
        raise Interrupted.from_exc(exc, left_behind(p.files, p.todo, done)) from None
    finally:
        source_chunks.close()
        progress.close()


def convert(model_dir: Path | str, out: Path | str, *, overwrite: bool = False, dsa: bool = True,
            quant: QuantOptions = QuantOptions(), output: OutputOptions = OutputOptions(),
            log: Callable[[str], None] = print) -> Ledger:
    """Convert a checkpoint directory to one GGUF file (or split parts); returns the ledger counts."""
    if names_a_directory(out):
        raise KimiError(f"{out}: names a directory; give the GGUF a file name")
    model_dir, out = Path(model_dir), Path(out)
    replace = overwrite or output.resume
    # Before the work of planning: the places and names, then the lock, then OUT itself when it
    # is one file (the part names need the plan).
    early = claim_outputs(model_dir, out, [_first_name(out, output.split)], None, output, replace)
    early.check(existing=False)
    with output_lock(out):
        early.check()
        cfg = load_config(model_dir)
        with open_checkpoint(model_dir, output.read_ahead) as ckpt:  # every shard there and as long as its header says
            p = plan_files(cfg, ckpt, model_dir, out, dsa, quant, output, log)
            claim_outputs(model_dir, out, p.files, p.todo, output, replace).check()
            check_free_space(out.parent, sum(f.size for f in p.todo))
            if output.export_rules is not None:
                log(write_quantize_rules(output.export_rules, p.types, replace))
            _write_all(p, ckpt, output, replace, log)
    return p.plan.ledger
