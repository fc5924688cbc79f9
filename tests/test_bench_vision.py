"""bench/vision.py's baseline is the same computation: the bench's own PyTorch MoonViT, on the tiny
checkpoint's tower, gives the reference's rows within the reference's float32 noise (as our graph
does, tests/ggml_graph_spec/vision/test_tower.py), so the benchmark compares like with like."""
from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import load_file

from bench.moonvit_torch import MoonViT

from tests.ggml_graph_spec.vision.conftest import INPUTS, floor, rel
from tests.ggml_graph_spec.vision.test_tower import TOLERANCE_FACTOR
from tests.support.paths import VISION


def test_the_benchs_pytorch_moonvit_computes_the_reference(k31pro_tiny_dir):
    with np.load(VISION / "vision_reference.npz") as z:
        ref = {k: z[k] for k in z.files}
    config = json.loads((k31pro_tiny_dir / "config.json").read_text())
    vision = config["vision_config"]
    weights = {n: t.float() for shard in sorted(k31pro_tiny_dir.glob("*.safetensors"))
               for n, t in load_file(str(shard)).items() if n.startswith(("vision_tower.", "mm_projector."))}
    model = MoonViT(weights, vision, vision["projector_ln_eps"])
    torch.set_num_threads(1)
    for name in INPUTS:
        rows = model(torch.from_numpy(ref[f"{name}/pixel_values"]), tuple(int(x) for x in ref[f"{name}/grid_thw"]))
        assert rows.dtype == torch.float32
        distance = rel(rows.numpy(), ref[f"f64/{name}/image_features"])
        assert distance <= TOLERANCE_FACTOR * floor(ref, "image_features"), (name, distance)
