"""Fixtures the runner's test modules share."""
from __future__ import annotations

from pathlib import Path

import pytest

import convert_kimi_k3


@pytest.fixture(scope="module")
def k31pro_f32_gguf(tmp_path_factory, k31pro_tiny_dir) -> Path:
    out = tmp_path_factory.mktemp("f32") / "k31pro-f32.gguf"
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), str(out), "--quiet", "--outtype", "f32",
                                 "--requantize-experts", "f32"]) == 0
    return out
