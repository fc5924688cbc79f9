"""Layers over devices: llama.cpp's rule on cumulative shares, and --tensor-split parsing."""
from __future__ import annotations

import pytest

from ggml_graph_spec.graph.placement import (INPUT_SEGMENT, OUTPUT_SEGMENT, Placement, PlacementError, layer_ranges,
                                       parse_tensor_split, split_layers)


@pytest.mark.parametrize("n_layers, shares, want", [
    (13, [1, 1, 1], [0] * 5 + [1] * 4 + [2] * 4),  # layer l on the first device with cum share > l/13
    (93, [1, 1], [0] * 47 + [1] * 46),
    (4, [3, 1], [0, 0, 0, 1]),
    (4, [0, 1, 0], [1, 1, 1, 1]),  # a 0 share takes no layer
    (4, [1, 0, 1], [0, 0, 2, 2]),
    (5, [0.1, 0.2, 0.7], [0, 1, 2, 2, 2]),  # 1/5 >= 0.1 -> device 1; 2/5 >= 0.3 -> device 2
])
def test_layers_go_in_contiguous_runs_by_cumulative_share(n_layers, shares, want):
    assert list(split_layers(n_layers, shares)) == want


def test_a_share_is_exact_at_the_boundary():
    # 0.25 + 0.25 + 0.5: layer 2 of 4 sits exactly at cum 0.5, which is not > 0.5 -> the third device.
    assert split_layers(4, [0.25, 0.25, 0.5]) == (0, 1, 2, 2)


@pytest.mark.parametrize("text, n, want", [
    ("3,1", 3, (3.0, 1.0, 0.0)), ("1", 2, (1.0, 0.0)), ("0,0,2", 3, (0.0, 0.0, 2.0)), ("0.5,0.5", 2, (0.5, 0.5))])
def test_tensor_split_pads_missing_shares_with_zero(text, n, want):
    assert parse_tensor_split(text, n) == want


@pytest.mark.parametrize("text, message", [
    ("a,b", "expected comma-separated numbers"), ("1,2,3,4", "4 values for 3 devices"), ("0,0", "not all 0"),
    ("-1,2", ">= 0"), ("nan", ">= 0"), ("inf,1", "finite"), ("", "expected comma-separated numbers")])
def test_bad_tensor_split_is_one_line(text, message):
    with pytest.raises(PlacementError, match=message):
        parse_tensor_split(text, 3)


def test_placement_puts_the_embedding_here_and_the_output_with_the_last_layer():
    p = Placement.plan(["RPC0[a:1]", "RPC1[b:2]", "CPU"], 6, [1, 1, 0])
    assert p.layer_device == (0, 0, 0, 1, 1, 1)
    assert p.device_of(INPUT_SEGMENT) == 2 and p.device_of(OUTPUT_SEGMENT) == 1 and p.device_of(4) == 1
    assert p.used() == [0, 1, 2] and p.layers_on(2) == []


def test_layer_ranges():
    assert layer_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert layer_ranges([]) == ""
