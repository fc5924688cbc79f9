"""The vision reference (tests/fixtures/k31pro-tiny/vision/) and encoders of the fixture's mmproj."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggml_graph_spec.vision.encode import VisionEncoder

from tests.support.paths import VISION

# The fixture's inputs: name -> its file(s) (a clip: its frames).
INPUTS = {"img_48x32": ["img_48x32.png"], "img_24x24": ["img_24x24.png"], "img_37x21": ["img_37x21.png"],
          "img_32x32": ["img_32x32.png"], "vid_2x32x24": ["vid_2x32x24_frame0.png", "vid_2x32x24_frame1.png"]}


def files(name: str) -> list[Path]:
    return [VISION / f for f in INPUTS[name]]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|: the reference's measure of a difference."""
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="session")
def ref() -> dict[str, np.ndarray]:
    with np.load(VISION / "vision_reference.npz") as z:
        return {k: z[k] for k in z.files}


def floor(ref: dict[str, np.ndarray], stage: str) -> float:
    """The reference's own float32-vs-float64 distance at a stage, the largest over the inputs."""
    return max(rel(ref[f"{name}/{stage}"], ref[f"f64/{name}/{stage}"]) for name in INPUTS)


@pytest.fixture(scope="module")
def exact_encoder(k31pro_tiny_mmproj):
    with VisionEncoder.open(k31pro_tiny_mmproj, exact=True, threads=1) as enc:
        yield enc


@pytest.fixture(scope="module")
def fast_encoder(k31pro_tiny_mmproj):
    with VisionEncoder.open(k31pro_tiny_mmproj, exact=False, threads=1) as enc:
        yield enc
