"""The host-side position terms against the reference: the bilinearly resized table (plus the time
embedding of a clip) and the 2D RoPE's cos and sin, within the reference's own float32 noise."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_graph_spec.vision.positions import interpolate_table, position_term, rope_angles, time_embedding

from .conftest import INPUTS, floor, rel

FACTOR = 2.0  # as test_tower.TOLERANCE_FACTOR: an independent float32 computation of the same values


@pytest.fixture(scope="module")
def table(exact_encoder) -> np.ndarray:
    return exact_encoder.weights.pos_table


@pytest.mark.parametrize("name", INPUTS)
def test_position_term_and_rope_match_the_reference(ref, table, exact_encoder, name):
    grid = tuple(int(x) for x in ref[f"{name}/grid_thw"])
    assert rel(position_term(table, grid), ref[f"f64/{name}/pos_emb"]) <= FACTOR * floor(ref, "pos_emb")
    cos, sin = rope_angles(grid, exact_encoder.cfg.head_dim)
    assert rel(cos, ref[f"f64/{name}/rope_cos"]) <= FACTOR * floor(ref, "rope_cos")
    assert rel(sin, ref[f"f64/{name}/rope_sin"]) <= FACTOR * floor(ref, "rope_sin")


def test_the_table_is_used_as_is_at_its_own_size_and_bilinear_otherwise(table):
    h0, w0, c = table.shape
    assert np.array_equal(interpolate_table(table, h0, w0), table.reshape(-1, c))
    half = interpolate_table(table, h0 // 2, w0 // 2)  # shrinking: half-pixel centres, no antialias
    want = table.reshape(h0 // 2, 2, w0 // 2, 2, c).astype(np.float64).mean(axis=(1, 3)).reshape(-1, c)
    assert rel(half, want) < 1e-6


def test_only_a_clip_gets_the_time_embedding(table):
    one = position_term(table, (1, 6, 8))
    two = position_term(table, (2, 6, 8))
    time = time_embedding(2, table.shape[2])
    assert np.array_equal(time[0], np.r_[np.zeros(16), np.ones(16)].astype(np.float32))  # frame 0: sin 0, cos 0
    assert np.allclose(two[:48], one + time[0]) and np.allclose(two[48:], one + time[1])
