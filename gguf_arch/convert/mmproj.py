"""The mmproj plan: the checkpoint's vision tower and projector matched against the mmproj tables
(`arch/mmproj.py`), its keys, and its final tensor types.

Like the text plan it reads only config.json, the processor settings and the shard headers:
every `vision_tower.*` / `mm_projector.*` tensor is consumed by a row of the table or is an error
(a bias the config says the tower has not, a block beyond vt_num_hidden_layers), and every row's
source is present with the shape and dtype the config implies. The text model's quantization
options never reach these tensors: only `--mmproj-tensor-type` rules do, and the protected set
keeps the norms at F32 whatever they say.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from gguf import GGUFValueType as T

from ..arch.mmproj import is_vision_source, mmproj_keys, plan_vision_tensors
from ..arch.vision import VisionConfig
from ..io.gguf_writer import KV
from ..io.safetensors import TensorMeta
from .plan import ConversionPlan, Ledger, match_sources, raise_first
from quant_rules.rules import QuantOptions, TensorTypeRule


@dataclass(frozen=True)
class MmprojOptions:
    """`--mmproj OUT` and the rules that may re-type its tensors (`--mmproj-tensor-type`)."""

    path: Path
    tensor_types: tuple[TensorTypeRule, ...] = ()

    @property
    def quant(self) -> QuantOptions:
        """The quantization options of the mmproj: its own rules, nothing of the text model's."""
        return QuantOptions(tensor_types=self.tensor_types)


def plan_mmproj(vcfg: VisionConfig, metas: Mapping[str, TensorMeta]) -> ConversionPlan:
    """Match the checkpoint's vision tensors against the table; CheckpointError names the first problem."""
    outputs, consumed, problems = match_sources(plan_vision_tensors(vcfg), metas)
    unknown = [n for n in metas if is_vision_source(n) and n not in consumed]
    raise_first([f"unknown tensor {n}: no row of the Kimi K3 vision table expects it for this config.json's "
                 "vision_config" for n in unknown] + problems)
    return ConversionPlan(vcfg, tuple(outputs), Ledger(len(consumed), len(metas) - len(consumed), len(outputs)))


def mmproj_metadata(vcfg: VisionConfig, model_dir: Path) -> list[KV]:
    """Every KV pair of the mmproj after general.architecture, in file order."""
    name = ("general.name", model_dir.resolve().name, T.STRING, None)
    keys = mmproj_keys(vcfg)
    return [keys[0], name, *keys[1:]]
