"""Shared fixtures: paths to ../shared and the fixtures converted once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from gguf_arch.convert import convert

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO / ".." / "shared"
FIXTURES = SHARED / "fixtures"
REFERENCE = SHARED / "reference"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return SHARED


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return REFERENCE


@pytest.fixture(scope="session")
def k3_tiny_dir() -> Path:
    return FIXTURES / "k3-tiny"


@pytest.fixture(scope="session")
def k31pro_tiny_dir() -> Path:
    return FIXTURES / "k31pro-tiny"


def _converted(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("gguf") / f"{model_dir.name}.gguf"
    convert(model_dir, out, log=lambda _msg: None)
    return out


@pytest.fixture(scope="session")
def k3_tiny_gguf(tmp_path_factory: pytest.TempPathFactory, k3_tiny_dir: Path) -> Path:
    """k3-tiny converted by this project's converter (read-only: copy before editing)."""
    return _converted(tmp_path_factory, k3_tiny_dir)


@pytest.fixture(scope="session")
def k31pro_tiny_gguf(tmp_path_factory: pytest.TempPathFactory, k31pro_tiny_dir: Path) -> Path:
    """k31pro-tiny converted by this project's converter (read-only: copy before editing)."""
    return _converted(tmp_path_factory, k31pro_tiny_dir)
