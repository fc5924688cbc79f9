"""The conversion plan: every checkpoint tensor matched against the tensor table (the key-coverage
ledger), each output's contract type, and the GGUF metadata.

The plan is computed from config.json and the shard headers alone: every source tensor is either
consumed by a row of the tensor table or deliberately skipped, and every tensor the table needs is
present with the shape and dtype the config implies. Only then is a byte written (`run.py`).
The quantization rules then pick each output's final type from its contract type
(`resolve_plan`): quant_rules sees typed tensors, never the plan's internals.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T

from ..arch.config import K3Config
from ..arch.keys import FILE_TYPE_MXFP4_MOE, QUANTIZATION_VERSION, model_keys
from ..arch.tensors import MXFP4_SUFFIXES, OUT_F32, OUT_MXFP4, PlannedTensor, is_skipped, plan_tensors
from ..arch.tokenizer import tokenizer_metadata
from ..arch.vision import VisionConfig
from ..arch.transforms import SAME_BYTES
from ..errors import CheckpointError
from ..io.gguf_writer import KV, OutputTensor
from ..io.safetensors import TensorMeta
from quant_rules.rules import QuantOptions, Resolution, TypedTensor, resolve_types

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
    output: OutputTensor  # at the contract type
    source_type: str  # what the rules call the source: its safetensors dtype, or MXFP4

    def typed(self) -> TypedTensor:
        """The output as the quantization rules see it."""
        o = self.output
        return TypedTensor(o.name, o.shape, self.source_type, o.ggml_type)


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
    cfg: K3Config | VisionConfig  # as converted (without the indexer when DSA is off); an mmproj's: the tower's
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


def _planned_output(pt: PlannedTensor, metas: Mapping[str, TensorMeta]) -> PlannedOutput:
    output = OutputTensor(pt.name, output_type(pt, metas[pt.sources[0][0]].dtype), pt.shape)
    source = "MXFP4" if output.ggml_type == Q.MXFP4 else metas[pt.sources[0][0]].dtype
    return PlannedOutput(pt, output, source)


def check_source_count(cfg: K3Config, metas: Mapping[str, object]) -> None:
    """Before any name is made: a config that needs more source tensors than the checkpoint holds
    (num_experts = 10**6 against a 384-expert index) is reported at once, with the first missing
    tensor, in bounded time and memory (the table's source lists are lazy, their lengths free)."""
    need = sum(len(pt.sources) for pt in plan_tensors(cfg) if not pt.spec.optional)
    if need <= len(metas):
        return
    first = next(((name, pt.name) for pt in plan_tensors(cfg) if not pt.spec.optional
                  for name, _ in pt.sources if name not in metas), None)
    where = f"missing tensor {first[0]} (source of GGUF {first[1]}); " if first else ""
    raise CheckpointError(f"{where}config.json implies {need} source tensors, the checkpoint holds {len(metas)} "
                          "(is num_experts, num_hidden_layers or a layer list larger than the checkpoint?)")


def match_sources(planned: Iterable[PlannedTensor], metas: Mapping[str, TensorMeta],
                  ) -> tuple[list[PlannedOutput], set[str], list[str]]:
    """(outputs whose sources are all present, the source names consumed, the problems found): every
    planned tensor's sources looked up with the shape and dtype the table expects."""
    problems: list[str] = []
    consumed: set[str] = set()
    outputs: list[PlannedOutput] = []
    for pt in planned:
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
            outputs.append(_planned_output(pt, metas))
    return outputs, consumed, problems


def raise_first(problems: list[str]) -> None:
    """CheckpointError naming the first problem and how many more there are (none: nothing)."""
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)


def plan_conversion(cfg: K3Config, metas: Mapping[str, TensorMeta], dsa: bool = True) -> ConversionPlan:
    """Match every checkpoint tensor against the table; CheckpointError names the first problem."""
    dropped = _indexer_sources(cfg) if not dsa else set()
    if not dsa:
        cfg = cfg.without_indexer()
    check_source_count(cfg, metas)
    outputs, consumed, problems = match_sources(plan_tensors(cfg), metas)
    skipped = [n for n in metas if n not in consumed and (is_skipped(n) or n in dropped)]
    unknown = [n for n in metas if n not in consumed and not (is_skipped(n) or n in dropped)]
    raise_first([_unknown_problem(n, cfg) for n in unknown] + problems)
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


def resolve_plan(outputs: Iterable[PlannedOutput], options: QuantOptions) -> Resolution:
    """The final type of every planned output under the user's quantization options."""
    return resolve_types((p.typed() for p in outputs), options)
