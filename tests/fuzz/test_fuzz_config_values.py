"""Numbers in config.json are checked against what they become (gguf_arch/io/gguf_values.py):
every integer field is written as (or checked against) a uint32 GGUF key, every float as a
float32 one. A value JSON holds but the key cannot (2**32, -1, 1e300, 1e-50, NaN) is refused with
one line naming the field, exit 2, by --dry-run too; whatever parses, the writer can pack."""
from __future__ import annotations

import copy
import json
import resource
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gguf_arch.arch.config import parse_config
from gguf_arch.arch.keys import model_keys
from gguf_arch.errors import ConfigError
from gguf_arch.io.gguf_values import problem

from .harness import FUZZ, assert_clean
from tests.support.cli import run_tool
from tests.support.paths import K3_TINY, K31PRO_TINY

RAW = json.loads((K31PRO_TINY / "config.json").read_text())
TEXT = RAW["text_config"]
NUMERIC = sorted(k for k, v in TEXT.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
KDA_NUMERIC = sorted(k for k, v in TEXT["linear_attn_config"].items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool))
HOSTILE = st.sampled_from([2**32, 2**32 - 1, 2**31, -1, 2**64, 10**30, 1e300, -1e300, 1e-50, 4e38,
                           float("nan"), float("inf"), 0, 0.5]) | st.integers() | st.floats()


@FUZZ
@given(section=st.sampled_from(["text", "kda"]), data=st.data(), value=HOSTILE)
def test_fuzz_numbers_parse_or_fail_cleanly_and_always_fit_their_keys(section, data, value):
    raw = copy.deepcopy(RAW)
    where = raw["text_config"] if section == "text" else raw["text_config"]["linear_attn_config"]
    where[data.draw(st.sampled_from(NUMERIC if section == "text" else KDA_NUMERIC))] = value
    try:
        cfg = parse_config(raw)
    except Exception as exc:  # noqa: BLE001 - which exception it is, is the point
        assert_clean(exc, ConfigError)
        return
    for key, v, vtype, sub in model_keys(cfg):
        assert problem(vtype, v, sub) is None, (key, v)


def _model_with(tmp_path: Path, field: str, value) -> Path:
    model = Path(shutil.copytree(K3_TINY, tmp_path / "model"))
    raw = json.loads((model / "config.json").read_text())
    raw["text_config"][field] = value
    (model / "config.json").write_text(json.dumps(raw))
    return model


@pytest.mark.parametrize("dry_run", [(), ("--dry-run",)], ids=["convert", "dry-run"])
@pytest.mark.parametrize("field,value,needle", [
    ("max_position_embeddings", 2**32, "0..4294967295 (uint32)"),  # was struct.error
    ("routed_scaling_factor", 1e300, "float32"),  # was OverflowError
    ("first_k_dense_replace", -1, "0..4294967295"),
    ("rms_norm_eps", 1e-50, "rounds to 0"),  # was silently written as 0.0
])
def test_config_values_a_key_cannot_hold(tmp_path, field, value, needle, dry_run):
    model = _model_with(tmp_path, field, value)
    res = run_tool("convert", model, tmp_path / "o.gguf", "--quiet", *dry_run)
    res.one_error_line(2, f"text_config.{field}", needle)
    assert not (tmp_path / "o.gguf").exists()


def _two_gib() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("dry_run", [(), ("--dry-run",)], ids=["convert", "dry-run"])
def test_a_million_experts_is_reported_in_bounded_memory(tmp_path, dry_run):
    """It ran minutes and 5 GB before; under a 2 GiB address-space limit it must answer at once
    with the first missing expert (the timeout only keeps a regression from hanging the suite)."""
    model = _model_with(tmp_path, "num_experts", 10**6)
    res = run_tool("convert", model, tmp_path / "o.gguf", "--quiet", *dry_run, preexec=_two_gib, timeout=60)
    res.one_error_line(2, "missing tensor", "experts.8.", "implies")


@pytest.mark.parametrize("n", [2**32 - 1, 10**9, 14])
def test_a_huge_layer_count_is_one_error_in_bounded_memory(n):
    """num_hidden_layers = 2^32 - 1 fits its uint32 key, but the layer-kind check built range(n)
    (the fuzz test above found it: MemoryError, or the OOM killer). Now the first uncovered layers
    are named and the rest counted, under a 2 GiB address-space limit."""
    raw = copy.deepcopy(RAW)
    raw["text_config"]["num_hidden_layers"] = n
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, hard))
    try:
        with pytest.raises(ConfigError) as e:
            parse_config(raw)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    line = assert_clean(e.value, ConfigError)
    assert "are in neither" in line and "layers [14" in line, line
    if n > 14 + 16:
        assert f"and {n - 13 - 16} more" in line, line
