"""From contract-type bytes to final-type bytes: the rules' decisions applied to a tensor stream.

The converter's plan gives each output tensor its contract type and the transforms produce its
bytes at that type; the rules (`rules.resolve_types`) pick the final type, `final_outputs` lays
the output out with it and `final_chunks` re-encodes when the two differ.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from gguf import GGMLQuantizationType as Q

from gguf_arch.io.gguf_writer import OutputTensor

from .quantize import ErrorMeter, reencode
from .rules import Decision, Resolution, type_name


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
