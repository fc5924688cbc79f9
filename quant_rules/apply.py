"""Glue between the converter's plan and the rules: typed tensors in, final-type bytes out."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Sequence

from gguf import GGMLQuantizationType as Q

from gguf_arch.safetensors_index import TensorMeta
from gguf_arch.writer import OutputTensor

from .quantize import ErrorMeter, reencode
from .rules import Decision, QuantOptions, Resolution, TypedTensor, resolve_types, type_name


def typed_tensors(outputs: Iterable[OutputTensor], first_source: Mapping[str, str],
                  metas: Mapping[str, TensorMeta]) -> list[TypedTensor]:
    """Planned outputs at their contract types; `first_source` maps a GGUF name to its first HF source."""
    return [TypedTensor(o.name, o.shape, "MXFP4" if o.ggml_type == Q.MXFP4 else metas[first_source[o.name]].dtype,
                        o.ggml_type) for o in outputs]


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


def resolve_outputs(outputs: Sequence[OutputTensor], first_source: Mapping[str, str],
                    metas: Mapping[str, TensorMeta], options: QuantOptions) -> Resolution:
    return resolve_types(typed_tensors(outputs, first_source, metas), options)
