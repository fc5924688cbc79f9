"""Which table a GGUF is checked against: the text model's (`kimi-k3`) or, for an mmproj
(`general.architecture = clip`), the vision tower's. The tensor diff and `--verify` read both
through `model_plan`, so an mmproj is compared with the checkpoint exactly like a text GGUF.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gguf import GGUFReader

from ..arch.config import K3Config, load_config, read_config_json
from ..arch.mmproj import ARCH as MMPROJ_ARCH
from ..arch.mmproj import plan_vision_tensors, vision_block
from ..arch.tensors import PlannedTensor, gguf_layer, plan_tensors
from ..arch.vision import VisionConfig, load_vision_config
from ..io.gguf_file import open_gguf


@dataclass(frozen=True)
class ModelPlan:
    """The checkpoint's plan for one GGUF: its config, every tensor it should hold, and how a GGUF
    name gives its layer (a text layer, or a vision block)."""

    cfg: K3Config | VisionConfig
    tensors: Callable[[], list[PlannedTensor]]
    layer_of: Callable[[str], int | None]

    @property
    def is_mmproj(self) -> bool:
        return isinstance(self.cfg, VisionConfig)


def gguf_architecture(reader: GGUFReader) -> str | None:
    field = reader.fields.get("general.architecture")
    try:
        return field.contents() if field is not None else None
    except UnicodeDecodeError:
        return None


def model_plan(model_dir: Path | str, gguf: Path | str) -> ModelPlan:
    """The text model's plan, or the vision tower's when the GGUF is an mmproj (config.json is read,
    and its absence reported, before the GGUF is opened)."""
    read_config_json(model_dir)
    if gguf_architecture(open_gguf(Path(gguf))) == MMPROJ_ARCH:
        vcfg, _origin = load_vision_config(model_dir)
        return ModelPlan(vcfg, lambda: list(plan_vision_tensors(vcfg)), vision_block)
    cfg = load_config(model_dir)
    return ModelPlan(cfg, lambda: list(plan_tensors(cfg)), gguf_layer)
