"""Run a conversion: plan it (`plan.py`, the mmproj's `mmproj.py`), lay out the files, then stream
every tensor once.

Each output file is written whole (`.partial`, fsync, rename) and then its per-tensor BLAKE3
manifest; with --resume, files an interrupted run finished and verified are kept. The text GGUF
and the mmproj are planned and checked together, then written in one pass (text first).
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..arch.config import load_config
from ..arch.keys import ARCH
from ..arch.mmproj import ARCH as MMPROJ_ARCH
from ..arch.vision import load_vision_config
from ..arch.transforms import tensor_chunks
from ..errors import Interrupted, KimiError
from ..errors.signals import deferred
from ..io.gguf_writer import KV, GGUFLayout, OutputTensor, tensor_offsets, write_gguf
from ..io.manifest import TensorHasher, write_manifest
from ..io.output_lock import lock_path, output_lock
from ..io.output_paths import OutputPaths, names_a_directory
from ..io.pipeline import Lookahead
from ..io.safetensors import open_checkpoint
from ..io.split import SplitLimits, split_layout
from ..io.split_names import part_path
from .finite import checked_chunks
from .mmproj import MmprojOptions, mmproj_metadata, plan_mmproj
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


def claim_outputs(model_dir: Path, targets: list[tuple[str, Path, list[OutputFile], list[OutputFile] | None]],
                  output: OutputOptions, replace: bool) -> OutputPaths:
    """Every file this run writes, for the guard: per output (what it is, its path, its files, those
    still to write); `todo` None: the part names are not planned yet, `files` then holds one name
    of the right length."""
    guard = OutputPaths([(model_dir, "the model directory")])
    for what, out, files, todo in targets:
        to_write = {id(f) for f in todo or ()}
        for f in files:
            written = id(f) in to_write
            guard.add_gguf(f.path, what if len(files) == 1 else f"part {f.path.name} of {what}", replace=replace,
                           written=written or (todo is None and not output.split.splits))
        guard.add(lock_path(out), f"the lock file of {what}", replace=True, written=False)  # taken over
    if output.log_json is not None:
        guard.add(output.log_json, "the JSON progress log (--log-json)", replace=replace)
    if output.export_rules is not None:
        guard.add(output.export_rules, "the llama-quantize rules (--export-quantize-rules)", replace=replace)
    return guard


def conversion_layout(plan: ConversionPlan, kv: tuple[KV, ...], quant: QuantOptions,
                      log: Callable[[str], None], arch: str = ARCH) -> tuple[GGUFLayout, Resolution]:
    """The whole output (before any split) with the final tensor types quant_rules picks."""
    # plan.outputs carry the contract types; quant_rules picks the final ones (and re-encodes).
    types = resolve_plan(plan.outputs, quant)
    for line in types.log:
        log(line)
    return GGUFLayout(arch, kv, final_outputs(types)), types


def output_files(out: Path, layout: GGUFLayout, split: SplitLimits) -> list[OutputFile]:
    return [OutputFile.planned(path, part) for path, part in split_layout(out, layout, split)]


def _first_name(out: Path, split: SplitLimits) -> OutputFile:
    """The output's one file, or a part name of the length every part name has (for the early check)."""
    empty = GGUFLayout(ARCH, (), ())
    return OutputFile(part_path(out, 1, 1) if split.splits else out, empty, 0)


def _write_files(files: list[OutputFile], source_chunks, progress: Progress, output: OutputOptions, replace: bool,
                 log, done: list[OutputFile]) -> None:
    """Each file streamed, renamed into place, then its manifest; one file at a time."""
    for f in files:
        with TensorHasher(output.threads) as hasher:
            chunks_for, close_bar = progress.track(f.path, f.layout, hasher.wrap(source_chunks))
            try:
                write_gguf(f.path, f.layout, chunks_for, replace)
            finally:
                close_bar()
            write_manifest(f.path, hasher.digests, replace)
            done.append(f)  # before the hashing thread is joined: a stop from here on sees it complete
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
    return _Planned(plan, types, files, files_to_write(files, log, output.threads) if output.resume else files)


def plan_mmproj_files(ckpt, model_dir: Path, mmproj: MmprojOptions, output: OutputOptions, log) -> _Planned:
    """The mmproj's plan, keys, types and files, as plan_files for the text model."""
    vcfg, media_origin = load_vision_config(model_dir)
    plan = plan_mmproj(vcfg, ckpt.metas)
    log(f"mmproj: {plan.ledger.summary()}; {media_origin}")
    layout, types = conversion_layout(plan, tuple(mmproj_metadata(vcfg, model_dir)), mmproj.quant, log, MMPROJ_ARCH)
    files = output_files(mmproj.path, layout, output.split)
    return _Planned(plan, types, files, files_to_write(files, log, output.threads) if output.resume else files)


def _together(planned: list[_Planned]) -> _Planned:
    """The text model's and the mmproj's plans as one run writes them: one progress, one log (the
    first plan's config and ledger)."""
    if len(planned) == 1:
        return planned[0]
    plans = [p.plan for p in planned]
    return _Planned(ConversionPlan(plans[0].cfg, tuple(o for pl in plans for o in pl.outputs), plans[0].ledger),
                    Resolution(tuple(d for p in planned for d in p.types.decisions), ()),
                    [f for p in planned for f in p.files], [f for p in planned for f in p.todo])


def source_chunks_for(p: _Planned, ckpt, output: OutputOptions, log) -> Callable[[OutputTensor], Iterator]:
    """Each output tensor's final bytes, scanned for non-finite values (what the writer pulls).
    A tensor written as the transforms produce it has them laid out for its offset in the file
    (`tensor_chunks`' place), so the writer writes them without a copy."""
    by_name = {o.output.name: o.tensor for o in p.plan.outputs}
    decided = {d.name: d for d in p.types.decisions}
    places = {name: at for f in p.todo for name, at in tensor_offsets(f.layout, f.size).items()}

    def source_chunks(t: OutputTensor) -> Iterator:
        d, pt = decided[t.name], by_name[t.name]
        place = places.get(t.name) if d.final_type == d.contract_type else None
        chunks = final_chunks(d, tensor_chunks(pt, d.contract_type, ckpt.read, output.repack_ahead, place), log)
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
            _write_files(p.todo, source_chunks, progress, output, replace, log, done)
    except KeyboardInterrupt as exc:  # Interrupted too
        raise Interrupted.from_exc(exc, left_behind(p.files, p.todo, done)) from None
    finally:
        source_chunks.close()
        progress.close()


def _check_free_space(files: list[OutputFile]) -> None:
    """Each output filesystem against the bytes this run writes on it."""
    need: dict[int, list] = {}  # device -> [a directory on it, bytes]
    for f in files:
        entry = need.setdefault(f.path.parent.stat().st_dev, [f.path.parent, 0])
        entry[1] += f.size
    for directory, size in need.values():
        check_free_space(directory, size)


def convert(model_dir: Path | str, out: Path | str | None, *, overwrite: bool = False, dsa: bool = True,
            quant: QuantOptions = QuantOptions(), output: OutputOptions = OutputOptions(),
            log: Callable[[str], None] = print, mmproj: MmprojOptions | None = None) -> Ledger:
    """Convert a checkpoint directory to one GGUF file (or split parts), and with `mmproj` its vision
    tower and projector to an mmproj GGUF too (out None: the mmproj only). Both are planned before
    either is written. Returns the text conversion's ledger counts (the mmproj's when out is None)."""
    for what, given in (("the GGUF", out), ("the mmproj", mmproj and mmproj.path)):
        if given is not None and names_a_directory(given):
            raise KimiError(f"{given}: names a directory; give {what} a file name")
    model_dir = Path(model_dir)
    outs = ([("the GGUF", Path(out))] if out is not None else []) + \
        ([("the mmproj", mmproj.path)] if mmproj is not None else [])
    replace = overwrite or output.resume
    # Before the work of planning: the places and names, then the locks, then each output itself
    # when it is one file (the part names need the plan).
    early = claim_outputs(model_dir, [(w, o, [_first_name(o, output.split)], None) for w, o in outs], output, replace)
    early.check(existing=False)
    with ExitStack() as locks:
        for _, o in outs:
            locks.enter_context(output_lock(o))
        early.check()
        cfg = load_config(model_dir) if out is not None else None
        with open_checkpoint(model_dir, output.read_ahead) as ckpt:  # every shard there and as long as its header says
            planned = [plan_files(cfg, ckpt, model_dir, Path(out), dsa, quant, output, log)] if out is not None else []
            if mmproj is not None:
                planned.append(plan_mmproj_files(ckpt, model_dir, mmproj, output, log))
            claim_outputs(model_dir, [(w, o, p.files, p.todo) for (w, o), p in zip(outs, planned)], output,
                          replace).check()
            p = _together(planned)
            _check_free_space(p.todo)
            if output.export_rules is not None:
                log(write_quantize_rules(output.export_rules, planned[0].types, replace))
            _write_all(p, ckpt, output, replace, log)
    return p.plan.ledger
