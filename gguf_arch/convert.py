"""HF Kimi K3 / K3.1-Pro checkpoint -> GGUF: plan (with the key-coverage ledger), then stream.

The plan is computed from config.json and the shard headers alone: every source tensor is either
consumed by a row of the tensor table or deliberately skipped, and every tensor the table needs is
present with the shape and dtype the config implies. Only then is a byte written.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T

from .config import K3Config, load_config
from .errors import CheckpointError, KimiError
from .integrity import TensorHasher, write_manifest
from .preflight import check_free_space
from .progress import Progress
from .resume import OutputFile, files_to_write, refuse_leftovers
from .keys import ARCH, FILE_TYPE_MXFP4_MOE, QUANTIZATION_VERSION, model_keys
from .safetensors_index import Checkpoint, TensorMeta, open_checkpoint
from .tensors import OUT_F32, OUT_MXFP4, PlannedTensor, is_skipped, plan_tensors
from .split import SplitLimits, split_layout
from .tokenizer import tokenizer_metadata
from .transforms import SAME_BYTES, tensor_chunks
from .writer import KV, GGUFLayout, OutputTensor, check_output, write_gguf
from quant_rules.apply import final_chunks, final_outputs, resolve_plan
from quant_rules.rules import QuantOptions, Resolution

MXFP4_SUFFIXES = (".weight_packed", ".weight_scale")


def output_type(pt: PlannedTensor, source_dtype: str) -> Q:
    """The contract GGML type of one output tensor: the single place that decides it.

    quant_rules may later re-type tensors the contract does not protect, at a user's request.
    """
    if pt.spec.out == OUT_MXFP4:
        return Q.MXFP4
    if pt.spec.out == OUT_F32:
        return Q.F32
    return SAME_BYTES[source_dtype]


@dataclass(frozen=True)
class PlannedOutput:
    tensor: PlannedTensor
    output: OutputTensor


@dataclass(frozen=True)
class Ledger:
    consumed: int  # source tensors read into some output
    skipped: int  # source tensors deliberately left out (vision, projector, indexer with --no-dsa)
    written: int  # GGUF tensors

    def summary(self) -> str:
        return (f"source tensors: {self.consumed + self.skipped} ({self.consumed} consumed, "
                f"{self.skipped} skipped); GGUF tensors written: {self.written}")


@dataclass(frozen=True)
class ConversionPlan:
    cfg: K3Config  # as converted (without the indexer when DSA is off)
    outputs: tuple[PlannedOutput, ...]
    ledger: Ledger


def _indexer_sources(cfg: K3Config) -> set[str]:
    return {name for pt in plan_tensors(cfg) if pt.spec.group == "dsa" for name, _ in pt.sources}


def _source_problem(name: str, want_shape: tuple, dtypes: frozenset, meta: TensorMeta, gguf: str) -> str | None:
    if meta.dtype not in dtypes:
        return (f"tensor {name} has dtype {meta.dtype}, expected {' or '.join(sorted(dtypes))} "
                f"(source of GGUF {gguf})")
    if meta.shape != want_shape:
        return (f"tensor {name} has shape {list(meta.shape)}, expected {list(want_shape)} from config.json "
                f"(source of GGUF {gguf})")
    return None


def _unknown_problem(name: str, cfg: K3Config) -> str:
    if name.endswith(MXFP4_SUFFIXES):
        return (f"tensor {name}: MXFP4 {name.rsplit('.', 1)[1]} found outside the routed experts "
                "(only block_sparse_moe.experts.E.w1/w2/w3 may be compressed)")
    if ".indexer." in name and cfg.indexer is None:
        return (f"unknown tensor {name}: an indexer tensor, but config.json has no index_* fields "
                "(or the layer is not an index layer)")
    return f"unknown tensor {name}: no row of the Kimi K3 tensor table expects it for this config.json"


def _planned_output(pt: PlannedTensor, metas: Mapping[str, TensorMeta]) -> OutputTensor:
    return OutputTensor(pt.name, output_type(pt, metas[pt.sources[0][0]].dtype), pt.shape)


def plan_conversion(cfg: K3Config, metas: Mapping[str, TensorMeta], dsa: bool = True) -> ConversionPlan:
    """Match every checkpoint tensor against the table; CheckpointError names the first problem."""
    dropped = _indexer_sources(cfg) if not dsa else set()
    if not dsa:
        cfg = cfg.without_indexer()
    problems: list[str] = []
    consumed: set[str] = set()
    outputs: list[PlannedOutput] = []
    for pt in plan_tensors(cfg):
        present = [name for name, _ in pt.sources if name in metas]
        if not present and pt.spec.optional:
            continue
        n_spec = len(pt.spec.sources)
        for i, (name, shape) in enumerate(pt.sources):
            if name not in metas:
                problems.append(f"missing tensor {name} (source of GGUF {pt.name})")
                continue
            consumed.add(name)
            problem = _source_problem(name, shape, pt.spec.sources[i % n_spec].dtypes, metas[name], pt.name)
            if problem:
                problems.append(problem)
        if len(present) == len(pt.sources):
            outputs.append(PlannedOutput(pt, _planned_output(pt, metas)))
    skipped = [n for n in metas if n not in consumed and (is_skipped(n) or n in dropped)]
    unknown = [n for n in metas if n not in consumed and not (is_skipped(n) or n in dropped)]
    problems = [_unknown_problem(n, cfg) for n in unknown] + problems
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)
    return ConversionPlan(cfg, tuple(outputs), Ledger(len(consumed), len(skipped), len(outputs)))


def gguf_metadata(cfg: K3Config, model_dir: Path) -> list[KV]:
    """Every KV pair after general.architecture, in file order."""
    return [
        ("general.type", "model", T.STRING, None),
        ("general.name", model_dir.resolve().name, T.STRING, None),
        *model_keys(cfg),
        ("general.file_type", FILE_TYPE_MXFP4_MOE, T.UINT32, None),
        *tokenizer_metadata(model_dir, cfg),
        ("general.quantization_version", QUANTIZATION_VERSION, T.UINT32, None),
    ]


def _releasing(chunks: Iterable, ckpt: Checkpoint) -> Iterator:
    """Pass chunks through; once the writer has taken one, drop the source pages read so far (bounded
    RSS). The writer thread may still be copying that chunk: its pages then fault back in from the
    page cache, the same bytes."""
    for chunk in chunks:
        yield chunk
        ckpt.release_pages()


def check_outside_model(model_dir: Path, out: Path) -> None:
    """The output may not land in the model directory: --overwrite there could replace a shard
    being read, and a stray GGUF among the shards is taken for part of the checkpoint."""
    where = out.parent.resolve()
    if where == model_dir.resolve() or model_dir.resolve() in where.parents:
        raise KimiError(f"{out}: is inside the model directory {model_dir}; write the GGUF elsewhere")


@dataclass(frozen=True)
class OutputOptions:
    """How the output is written: split limits, resume, progress reporting."""

    split: SplitLimits = SplitLimits()
    resume: bool = False  # keep verified finished files of an interrupted run, rewrite the rest
    progress_bar: bool = False  # a tqdm bar per file on stderr
    log_json: Path | None = None  # one JSON progress line per tensor


def conversion_layout(plan: ConversionPlan, kv: tuple[KV, ...], metas: Mapping[str, TensorMeta],
                      quant: QuantOptions, log: Callable[[str], None]) -> tuple[GGUFLayout, Resolution]:
    """The whole output (before any split) with the final tensor types quant_rules picks."""
    # plan.outputs carry the contract types; quant_rules picks the final ones (and re-encodes).
    types = resolve_plan(plan.outputs, metas, quant)
    for line in types.log:
        log(line)
    return GGUFLayout(ARCH, kv, final_outputs(types)), types


def output_files(out: Path, layout: GGUFLayout, split: SplitLimits) -> list[OutputFile]:
    return [OutputFile.planned(path, part) for path, part in split_layout(out, layout, split)]


def _files_to_write(files: list[OutputFile], overwrite: bool, resume: bool, log) -> list[OutputFile]:
    if resume:
        return files_to_write(files, log)
    refuse_leftovers(files, overwrite)
    return files


def _write_files(files: list[OutputFile], source_chunks, progress: Progress, replace: bool, log) -> None:
    """Each file streamed, renamed into place, then its manifest; one file at a time."""
    for f in files:
        hasher = TensorHasher()
        chunks_for, close_bar = progress.track(f.path, f.layout, hasher.wrap(source_chunks))
        try:
            write_gguf(f.path, f.layout, chunks_for, replace)
        finally:
            close_bar()
        write_manifest(f.path, hasher.digests)
        log(f"wrote {f.path}")


def convert(model_dir: Path | str, out: Path | str, *, overwrite: bool = False, dsa: bool = True,
            quant: QuantOptions = QuantOptions(), output: OutputOptions = OutputOptions(),
            log: Callable[[str], None] = print) -> Ledger:
    """Convert a checkpoint directory to one GGUF file (or split parts); returns the ledger counts."""
    model_dir, out = Path(model_dir), Path(out)
    check_outside_model(model_dir, out)
    if not output.resume and output.split == SplitLimits():
        check_output(out, overwrite)  # before the work of planning; split part names need the plan
    cfg = load_config(model_dir)
    with open_checkpoint(model_dir) as ckpt:  # every shard there and as long as its header says
        plan = plan_conversion(cfg, ckpt.metas, dsa=dsa)
        kv = tuple(gguf_metadata(plan.cfg, model_dir))  # reads the tokenizer: fails before any output
        log(plan.ledger.summary())
        if cfg.indexer is not None and not dsa:
            log("DSA disabled (--no-dsa): indexer keys and tensors left out, written as plain kimi-k3")
        layout, types = conversion_layout(plan, kv, ckpt.metas, quant, log)
        files = output_files(out, layout, output.split)
        todo = _files_to_write(files, overwrite, output.resume, log)
        check_free_space(out.parent, sum(f.size for f in todo))
        by_name = {p.output.name: p.tensor for p in plan.outputs}
        decided = {d.name: d for d in types.decisions}

        def source_chunks(t: OutputTensor) -> Iterator:
            d = decided[t.name]
            return _releasing(final_chunks(d, tensor_chunks(by_name[t.name], d.contract_type, ckpt.read), log), ckpt)
        progress = Progress(sum(t.nbytes for f in todo for t in f.layout.tensors), bar=output.progress_bar,
                            log_json=output.log_json)
        try:
            _write_files(todo, source_chunks, progress, overwrite or output.resume, log)
        finally:
            progress.close()
    return plan.ledger
