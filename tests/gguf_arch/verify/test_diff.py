"""kimi-k3-diff: the converted fixtures match the checkpoint tensor by tensor, and damage is named."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from gguf_arch.arch.config import load_config
from gguf_arch.arch.tensors import TABLE, plan_tensors
from gguf_arch.io.safetensors import open_checkpoint
from gguf_arch.verify import bounds, diff, reference
from gguf_arch.verify.diff import EXACT, MISMATCH, MISSING, SHAPE, TYPE, UNEXPECTED, WITHIN_BOUND, diff_gguf, main

from tests.support.gguf_edit import edited_copy, rewritten_copy, tensor_info
from tests.support.paths import REPO
from tests.support.source import import_graph, project_modules


# k3-tiny / k31pro-tiny layout (fixture READMEs): layer 0 KDA + dense, 1 KDA + MoE, 3 MLA + MoE
# (k31pro: + indexer); 8 experts; gate/up experts [32, 64], down [64, 32]; 4 MLA heads,
# kv_lora 32, qk_nope 16, v 16; KDA 4 heads, A_log [16].
N_EXPERTS = 8


def by_name(report: diff.DiffReport) -> dict[str, diff.TensorDiff]:
    return {t.name: t for t in report.tensors}


def planned_names(model_dir: Path, layers: tuple) -> list[str]:
    """The plan for these layers (None: globals), less optional rows the checkpoint lacks."""
    present = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    return [p.name for p in plan_tensors(load_config(model_dir))
            if p.layer in layers and (not p.spec.optional or p.sources[0][0] in present)]


@pytest.fixture(params=["k3", "k31pro"])
def converted(request) -> tuple[Path, Path]:
    """(model dir, its converted GGUF) for each fixture."""
    return (request.getfixturevalue(f"{request.param}_tiny_dir"), request.getfixturevalue(f"{request.param}_tiny_gguf"))


@pytest.fixture(scope="module")
def k3_baseline(k3_tiny_dir, k3_tiny_gguf) -> dict[str, str]:
    """Verdict of every tensor of the undamaged k3 conversion, to show damage stays local."""
    return {t.name: t.status for t in diff_gguf(k3_tiny_dir, k3_tiny_gguf).tensors}


def assert_only_damaged(report: diff.DiffReport, baseline: dict[str, str], name: str) -> diff.TensorDiff:
    """`name` fails and every other tensor keeps its undamaged verdict."""
    got = by_name(report)
    assert not got[name].ok, got[name]
    assert {n: t.status for n, t in got.items() if n != name} == {n: s for n, s in baseline.items() if n != name}
    return got[name]


# ---- the converted fixtures are exact ------------------------------------------------------

def test_every_tensor_of_every_layer_is_exact(converted):
    model_dir, gguf = converted
    report = diff_gguf(model_dir, gguf)
    assert [t.name for t in report.tensors] == planned_names(model_dir, (None, *range(13)))
    assert {t.name: t.detail for t in report.tensors if t.status != EXACT} == {}
    assert report.ok and report.layers == tuple(range(13))


def test_layer_selection_and_globals(converted):
    model_dir, gguf = converted
    report = diff_gguf(model_dir, gguf, layers=[3, 0], include_globals=False)
    assert report.layers == (0, 3)
    assert [t.name for t in report.tensors] == planned_names(model_dir, (0, 3))
    with_globals = diff_gguf(model_dir, gguf, layers=[12])
    assert {t.layer for t in with_globals.tensors} == {None, 12}


# ---- guard tests: deliberately damaged GGUFs -------------------------------------------------

@pytest.mark.parametrize("fixture, name, shape", [
    ("k3", "token_embd.weight", (912, 64)),  # bf16 passthrough
    ("k3", "blk.1.ffn_routed_up.weight", (64, 64)),
    ("k31pro", "blk.3.indexer.attn_k.weight", (16, 64)),
])
def test_flipped_byte_in_a_bf16_tensor_is_named(request, monkeypatch, tmp_path, fixture, name, shape):
    monkeypatch.setattr(reference, "CHUNK_ELEMS", 3 * 64)  # several row chunks per tensor: their offsets count
    model_dir, src = request.getfixturevalue(f"{fixture}_tiny_dir"), request.getfixturevalue(f"{fixture}_tiny_gguf")
    baseline = {t.name: t.status for t in diff_gguf(model_dir, src).tensors}
    row, col = shape[0] - 2, 7

    def flip(raw):
        raw[2 * (row * shape[1] + col) + 1] ^= 0x40  # high byte: an exponent bit of element (row, col)

    report = diff_gguf(model_dir, edited_copy(src, tmp_path / "flip.gguf", name, flip))
    bad = assert_only_damaged(report, baseline, name)
    assert bad.status == MISMATCH
    assert [(m.coords, m.flat, m.unit) for m in bad.mismatches] == [((row, col), row * shape[1] + col, None)]


def _expert_bytes(raw: np.ndarray) -> np.ndarray:
    return raw.reshape(N_EXPERTS, -1)


def test_swapped_experts_are_named(tmp_path, k3_tiny_dir, k3_tiny_gguf, k3_baseline):
    name = "blk.1.ffn_gate_exps.weight"

    def swap(raw):
        experts = _expert_bytes(raw)
        experts[[2, 5]] = experts[[5, 2]]

    report = diff_gguf(k3_tiny_dir, edited_copy(k3_tiny_gguf, tmp_path / "swap.gguf", name, swap))
    bad = assert_only_damaged(report, k3_baseline, name)
    assert [m.unit for m in bad.mismatches] == ["expert 2", "expert 5"]
    assert all(m.coords[0] == int(m.unit.split()[1]) for m in bad.mismatches)
    assert "expert 2: first mismatch" in bad.detail and "expert 5: first mismatch" in bad.detail


def test_transposed_expert_is_named(tmp_path, k3_tiny_dir, k3_tiny_gguf, k3_baseline):
    """Expert 3's blocks laid out column-major: the same bytes in transposed block order."""
    name = "blk.1.ffn_up_exps.weight"
    rows, blocks_per_row = 32, 64 // 32

    def transpose(raw):
        expert = _expert_bytes(raw)[3]
        grid = expert.reshape(rows, blocks_per_row, 17).copy()
        expert[:] = grid.transpose(1, 0, 2).reshape(-1)

    report = diff_gguf(k3_tiny_dir, edited_copy(k3_tiny_gguf, tmp_path / "transposed.gguf", name, transpose))
    bad = assert_only_damaged(report, k3_baseline, name)
    assert [m.unit for m in bad.mismatches] == ["expert 3"]


def test_wrong_ssm_a_is_named(tmp_path, k3_tiny_dir, k3_tiny_gguf, k3_baseline):
    """ssm_a taken from A_log's zero padding (entries 4..7) instead of the first num_heads entries."""
    name = "blk.4.ssm_a"

    def from_padding(raw):
        raw.view(np.float32)[:] = -np.exp(np.zeros(4, dtype=np.float32))

    report = diff_gguf(k3_tiny_dir, edited_copy(k3_tiny_gguf, tmp_path / "ssm_a.gguf", name, from_padding))
    bad = assert_only_damaged(report, k3_baseline, name)
    assert bad.status == MISMATCH and bad.mismatches[0].found == -1.0 and bad.mismatches[0].coords == (0,)


def test_k_b_not_transposed_is_named(tmp_path, k3_tiny_dir, k3_tiny_gguf, k3_baseline):
    name, heads, kv_lora, nope = "blk.3.attn_k_b.weight", 4, 32, 16

    def untranspose(raw):
        k_b = raw.view(np.uint16).reshape(heads, kv_lora, nope).copy()
        raw.view(np.uint16)[:] = k_b.transpose(0, 2, 1).reshape(-1)  # kv_b's [nope, kv_lora] rows as stored

    report = diff_gguf(k3_tiny_dir, edited_copy(k3_tiny_gguf, tmp_path / "k_b.gguf", name, untranspose))
    bad = assert_only_damaged(report, k3_baseline, name)
    assert bad.status == MISMATCH and bad.mismatches[0].coords[0] == 0


# ---- other types: quantized outputs within their bound ---------------------------------------

def _values(gguf: Path, name: str) -> np.ndarray:
    t = tensor_info(gguf, name)
    return dequantize(np.asarray(t.data), t.tensor_type)


def test_q8_0_trunk_tensor_is_within_bound(tmp_path, k3_tiny_dir, k3_tiny_gguf, k3_baseline):
    name = "blk.1.ffn_routed_up.weight"
    q8 = quantize(_values(k3_tiny_gguf, name), Q.Q8_0)
    report = diff_gguf(k3_tiny_dir, rewritten_copy(k3_tiny_gguf, tmp_path / "q8.gguf", {name: (q8, Q.Q8_0)}))
    got = by_name(report)[name]
    assert got.status == WITHIN_BOUND and got.gguf_type == "Q8_0" and "within Q8_0 bound" in got.detail
    assert {n: t.status for n, t in by_name(report).items() if n != name} == {n: s for n, s in k3_baseline.items() if n != name}


def test_q8_0_beyond_bound_is_a_mismatch(tmp_path, k3_tiny_dir, k3_tiny_gguf):
    name = "blk.1.ffn_routed_up.weight"
    q8 = quantize(_values(k3_tiny_gguf, name), Q.Q8_0)
    quants = q8.reshape(-1, 34)[:, 2:].view(np.int8)  # per block: f16 scale, then 32 int8
    quants[0, 5] += -3 if quants[0, 5] > 0 else 3  # three quantization steps off
    report = diff_gguf(k3_tiny_dir, rewritten_copy(k3_tiny_gguf, tmp_path / "q8bad.gguf", {name: (q8, Q.Q8_0)}))
    got = by_name(report)[name]
    assert got.status == MISMATCH and "beyond the Q8_0 bound" in got.detail
    assert got.mismatches[0].coords == (0, 5)


def test_requantized_experts_are_compared_per_expert_within_bound(tmp_path, k3_tiny_dir, k3_tiny_gguf):
    name = "blk.1.ffn_down_exps.weight"
    q8 = quantize(_values(k3_tiny_gguf, name), Q.Q8_0)
    report = diff_gguf(k3_tiny_dir, rewritten_copy(k3_tiny_gguf, tmp_path / "exq8.gguf", {name: (q8, Q.Q8_0)}),
                       layers=[1])
    assert by_name(report)[name].status == WITHIN_BOUND
    q8.reshape(N_EXPERTS, -1, 34)[6, 0, 2:].view(np.int8)[:] = 0  # zero one block of expert 6
    report = diff_gguf(k3_tiny_dir, rewritten_copy(k3_tiny_gguf, tmp_path / "exq8bad.gguf", {name: (q8, Q.Q8_0)}),
                       layers=[1])
    assert [m.unit for m in by_name(report)[name].mismatches] == ["expert 6"]


def test_widened_to_f32_is_within_the_zero_bound(tmp_path, k3_tiny_dir, k3_tiny_gguf):
    name = "token_embd.weight"
    wide = _values(k3_tiny_gguf, name)
    report = diff_gguf(k3_tiny_dir, rewritten_copy(k3_tiny_gguf, tmp_path / "f32.gguf", {name: (wide, Q.F32)}), layers=[0])
    assert by_name(report)[name].status == WITHIN_BOUND
    wide[0, 0] = np.nextafter(wide[0, 0], np.float32(np.inf))  # one ulp is not exact
    report = diff_gguf(k3_tiny_dir, rewritten_copy(k3_tiny_gguf, tmp_path / "f32b.gguf", {name: (wide, Q.F32)}), layers=[0])
    assert by_name(report)[name].status == MISMATCH


def test_intended_types_make_a_retyped_tensor_a_difference(tmp_path, k31pro_tiny_dir, k31pro_tiny_gguf):
    """indexer.proj must stay F32 (docs/reference/gguf.md#indexer-tensors): BF16 is within bound, but not
    what was intended."""
    name = "blk.3.indexer.proj.weight"
    narrowed = quantize(_values(k31pro_tiny_gguf, name), Q.BF16)
    out = rewritten_copy(k31pro_tiny_gguf, tmp_path / "bf16.gguf", {name: (narrowed, Q.BF16)})
    assert by_name(diff_gguf(k31pro_tiny_dir, out, layers=[3]))[name].status == WITHIN_BOUND
    got = by_name(diff_gguf(k31pro_tiny_dir, out, layers=[3], intended_types={name: "F32"}))[name]
    assert got.status == TYPE and got.detail == "GGUF type BF16, the conversion intended F32"
    assert by_name(diff_gguf(k31pro_tiny_dir, k31pro_tiny_gguf, layers=[3], intended_types={name: "F32"}))[name].ok


def test_gate_and_up_experts_swapped_are_named(tmp_path, k3_tiny_dir, k3_tiny_gguf, k3_baseline):
    """w1 -> gate, w3 -> up: a converter that maps them the other way fails on every expert of both."""
    gate, up = "blk.5.ffn_gate_exps.weight", "blk.5.ffn_up_exps.weight"
    swapped = {gate: (tensor_info(k3_tiny_gguf, up).data, Q.MXFP4), up: (tensor_info(k3_tiny_gguf, gate).data, Q.MXFP4)}
    got = by_name(diff_gguf(k3_tiny_dir, rewritten_copy(k3_tiny_gguf, tmp_path / "gu.gguf", swapped)))
    for name in (gate, up):
        assert [m.unit for m in got[name].mismatches] == [f"expert {e}" for e in range(N_EXPERTS)]
    assert {n: t.status for n, t in got.items() if n not in (gate, up)} == {
        n: s for n, s in k3_baseline.items() if n not in (gate, up)}


def test_type_without_a_bound_is_a_type_difference(tmp_path, k3_tiny_dir, k3_tiny_gguf):
    name = "blk.1.ffn_routed_up.weight"
    # [64, 64] as IQ4_NL (18 bytes per 32 values): gguf-py cannot encode it, and its values do not matter here
    iq4 = np.zeros((64, 64 // 32 * 18), np.uint8)
    report = diff_gguf(k3_tiny_dir, rewritten_copy(k3_tiny_gguf, tmp_path / "iq4.gguf", {name: (iq4, Q.IQ4_NL)}), layers=[1])
    got = by_name(report)[name]
    assert got.status == TYPE and "no error bound known for IQ4_NL" in got.detail and "expected BF16" in got.detail


# ---- missing, unexpected, shape ----------------------------------------------------------------

def test_missing_unexpected_and_shape(tmp_path, k3_tiny_dir, k3_tiny_gguf):
    a_log_shape = np.zeros((2, 2), dtype=np.float32)
    out = rewritten_copy(k3_tiny_gguf, tmp_path / "edit.gguf",
                         {"blk.3.attn_v_b.weight": None, "blk.0.ssm_a": (a_log_shape, Q.F32)},
                         {"blk.3.attn_kv_b.weight": np.zeros((4, 4), np.float32),
                          "blk.40.attn_norm.weight": np.zeros(4, np.float32),
                          "rope_freqs.weight": np.zeros(4, np.float32)})
    got = by_name(diff_gguf(k3_tiny_dir, out))
    assert got["blk.3.attn_v_b.weight"].status == MISSING
    assert got["blk.0.ssm_a"].status == SHAPE and "[2, 2]" in got["blk.0.ssm_a"].detail
    assert {n for n, t in got.items() if t.status == UNEXPECTED} == {
        "blk.3.attn_kv_b.weight", "blk.40.attn_norm.weight", "rope_freqs.weight"}
    scoped = by_name(diff_gguf(k3_tiny_dir, out, layers=[5], include_globals=False))
    assert {n for n, t in scoped.items() if t.status == UNEXPECTED} == {"blk.40.attn_norm.weight"}


# ---- the error bounds hold for gguf-py's own quantizers ----------------------------------------

_finite = dict(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.sampled_from([32, 64, 96]), elements=st.floats(-1e4, 1e4, **_finite)),
       st.sampled_from([1.0, 1e-3, 1e-6, 1e-9]))
def test_q8_0_bound_holds(x, scale):
    x = (x * np.float32(scale)).astype(np.float32)
    err = np.abs(dequantize(quantize(x, Q.Q8_0), Q.Q8_0).astype(np.float64) - x)
    assert (err <= bounds.q8_0_bound(x)).all()


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, 64, elements=st.floats(-6e4, 6e4, **_finite)))
def test_f16_and_bf16_bounds_hold(x):
    assert (np.abs(x.astype(np.float16).astype(np.float64) - x) <= bounds.f16_bound(x)).all()
    bf16 = dequantize(quantize(x, Q.BF16), Q.BF16)
    assert (np.abs(bf16.astype(np.float64) - x) <= bounds.bf16_bound(x)).all()


def test_q8_0_bound_is_tight_enough_to_catch_one_step():
    x = np.linspace(-1, 1, 32, dtype=np.float32)
    assert (bounds.q8_0_bound(x) < 1 / 127).all()  # one quantization step is d = max|x| / 127


# ---- the reference forms ----------------------------------------------------------------------

def test_compressed_mxfp4_decoder_follows_the_spec():
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 0xF1  # element 0: code 1 (0.5), element 1: code 15 (-6)
    packed[0, 15] = 0x8C  # element 30: code 12 (-2), element 31: code 8 (-0)
    values = reference.decode_compressed_mxfp4(packed, np.array([[128]], np.uint8))  # x 2^(128-127)
    assert values[0, :2].tolist() == [1.0, -12.0] and values[0, 30:].tolist() == [-4.0, 0.0]
    assert np.signbit(values[0, 31]) and not values[0, 2:30].any()
    assert np.isnan(reference.decode_compressed_mxfp4(packed, np.array([[255]], np.uint8))).all()  # E8M0 NaN


def test_every_table_transform_has_a_reference():
    assert {s.transform for s in TABLE} <= set(reference.REFERENCES)


# The write path: a bug there must not also be in the check meant to catch it.
WRITE_PATH = ("gguf_arch.arch.transforms", "gguf_arch.io.gguf_writer", "gguf_arch.convert", "quant_rules")
# What the check may take from arch.mxfp4, whose repack is write path: the format's facts and values.
MXFP4_FACTS = {"BLOCK", "E2M1", "dequantize_compressed"}


def test_diff_is_independent_of_the_write_path():
    graph = import_graph()
    seen, todo = set(), ["gguf_arch.verify.diff"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    assert not {m for m in seen if m.startswith(WRITE_PATH)}, sorted(seen)
    for name in seen & {m for m in graph if m.startswith("gguf_arch.verify.")}:
        for node in ast.walk(project_modules()[name].tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("mxfp4"):
                assert {a.name for a in node.names} <= MXFP4_FACTS, (name, [a.name for a in node.names])


def test_experts_are_decoded_one_at_a_time(monkeypatch, k3_tiny_dir, k3_tiny_gguf):
    shapes = []
    real = reference.decode_compressed_mxfp4
    monkeypatch.setattr(reference, "decode_compressed_mxfp4", lambda p, s: shapes.append(p.shape) or real(p, s))
    assert diff_gguf(k3_tiny_dir, k3_tiny_gguf, layers=[1], include_globals=False).tensors
    assert sorted(set(shapes)) == [(32, 32), (64, 16)] and len(shapes) == 3 * N_EXPERTS


# ---- command line ---------------------------------------------------------------------------

def test_cli_text_exact(capsys, k3_tiny_dir, k3_tiny_gguf):
    assert main([str(k3_tiny_dir), str(k3_tiny_gguf), "--layers", "3,12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    n = len(planned_names(k3_tiny_dir, (None, 3, 12)))
    assert len(lines) == n + 1 and lines[-1].startswith(f"{n} tensors over 2 layers")
    assert "blk.3.attn_k_b.weight  exact" in lines


def test_cli_reports_damage_and_exits_1(capsys, tmp_path, k3_tiny_dir, k3_tiny_gguf):
    def zero(raw):
        raw[:] = 0

    bad = edited_copy(k3_tiny_gguf, tmp_path / "z.gguf", "blk.3.attn_v_b.weight", zero)
    assert main([str(k3_tiny_dir), str(bad), "--layers", "3", "--no-globals"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(l.startswith("blk.3.attn_v_b.weight  MISMATCH  first mismatch at") for l in out)
    assert out[-1].endswith("DIFFERENT")
    assert main([str(k3_tiny_dir), str(bad), "--layers", "3", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (entry,) = [t for t in report["tensors"] if t["status"] != EXACT]
    assert not report["ok"] and entry["name"] == "blk.3.attn_v_b.weight" and entry["mismatches"][0]["coords"]


@pytest.mark.parametrize("args, message", [
    (["--layers", "3,99"], "layers [99] are outside 0..12"),
    (["--layers", "three"], "--layers must be 'all' or comma-separated"),
])
def test_cli_bad_layers_exit_2(capsys, k3_tiny_dir, k3_tiny_gguf, args, message):
    assert main([str(k3_tiny_dir), str(k3_tiny_gguf), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_module_entry_point_bad_inputs_one_line(tmp_path, k3_tiny_dir):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    for model, gguf, message in ((k3_tiny_dir, not_gguf, "not a readable GGUF file"),
                                 (k3_tiny_dir, tmp_path / "absent.gguf", "absent.gguf: not found"),
                                 (tmp_path, not_gguf, "config.json: not found")):
        run = subprocess.run([sys.executable, "-m", "gguf_arch.verify.diff", str(model), str(gguf)],
                             capture_output=True, text=True, cwd=REPO)
        assert run.returncode == 2 and run.stdout == ""
        assert message in run.stderr and len(run.stderr.splitlines()) == 1


def test_ssm_a_reference_is_llama_cpp_value(converted):
    """-exp in float64 rounded once equals llama.cpp's -torch.exp(A_log.float()) on every fixture head."""
    import torch  # the test extra; llama.cpp's converter computes ssm_a with it
    model_dir, _ = converted
    cfg = load_config(model_dir)
    ckpt = open_checkpoint(model_dir)
    for plan in plan_tensors(cfg):
        if plan.transform == "neg_exp_heads":
            sources = diff.read_sources(ckpt, plan)
            (chunk,) = reference.REFERENCES[plan.transform](cfg, plan, sources)
            a_log = torch.from_numpy(np.array(sources[0].array, dtype=np.float32))
            llama = (-torch.exp(a_log.float()[: cfg.kda.num_heads])).numpy()
            assert chunk.values[0].view(np.uint32).tolist() == llama.view(np.uint32).tolist(), plan.name
