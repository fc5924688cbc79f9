"""Glue between the converter's plan and the rules: planned outputs in, final-type bytes out.

The converter's plan gives each output tensor its contract type (`gguf_arch.convert.output_type`)
and the transforms produce its bytes at that type; the rules then pick the final type and
`final_chunks` re-encodes when the two differ.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

from gguf import GGMLQuantizationType as Q

from gguf_arch.safetensors_index import TensorMeta
from gguf_arch.writer import OutputTensor

from .quantize import ErrorMeter, reencode
from .rules import Decision, QuantOptions, Resolution, TypedTensor, resolve_types, type_name

if TYPE_CHECKING:  # gguf_arch.convert imports this module
    from gguf_arch.convert import PlannedOutput


def typed_tensor(p: "PlannedOutput", metas: Mapping[str, TensorMeta]) -> TypedTensor:
    o = p.output
    source = "MXFP4" if o.ggml_type == Q.MXFP4 else metas[p.tensor.sources[0][0]].dtype
    return TypedTensor(o.name, o.shape, source, o.ggml_type)


def resolve_plan(outputs: Iterable["PlannedOutput"], metas: Mapping[str, TensorMeta],
                 options: QuantOptions) -> Resolution:
    return resolve_types((typed_tensor(p, metas) for p in outputs), options)


def final_outputs(resolution: Resolution) -> tuple[OutputTensor, ...]:
    return tuple(OutputTensor(d.name, d.final_type, d.shape) for d in resolution.decisions)


def final_chunks(d: Decision, contract_chunks: Iterable[memoryview],
                 log: Callable[[str], None]) -> Iterator[memoryview]:
    """The tensor's bytes at its final type, from its bytes at the contract type."""
    if d.final_type == d.contract_type:
        yield from contract_chunks
        return
    meter = ErrorMeter() if d.contract_type == Q.MXFP4 else None
    yield from reencode(contract_chunks, d.contract_type, d.final_type, d.shape[-1], meter)
    if meter is not None:
        log(f"{d.name}: requantized {type_name(d.contract_type)} -> {type_name(d.final_type)}, "
            f"relative error ||w'-w||/||w|| = {meter.relative:.3%}")
