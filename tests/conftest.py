"""Session fixtures: the reference checkpoints in tests/fixtures/ and their conversions (made once)."""
from __future__ import annotations

from pathlib import Path

import pytest

from gguf_arch.convert.mmproj import MmprojOptions
from gguf_arch.convert.run import convert

from tests.support.paths import FIXTURES, K3_TINY, K31PRO_TINY, REFERENCE


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return REFERENCE


@pytest.fixture(scope="session")
def k3_tiny_dir() -> Path:
    return K3_TINY


@pytest.fixture(scope="session")
def k31pro_tiny_dir() -> Path:
    return K31PRO_TINY


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


@pytest.fixture(scope="session")
def k31pro_tiny_mmproj(tmp_path_factory: pytest.TempPathFactory, k31pro_tiny_dir: Path) -> Path:
    """k31pro-tiny's vision tower and projector as an mmproj (read-only: copy before editing)."""
    out = tmp_path_factory.mktemp("mmproj") / "k31pro-tiny-mmproj.gguf"
    convert(k31pro_tiny_dir, None, mmproj=MmprojOptions(out), log=lambda _msg: None)
    return out
