"""kimi-k3-calibrate and the graph taps it reads (ggml_graph_spec/graph/taps.py).

* the taps: against numpy on one MoE block (test_blocks' random layer, exact path), and absent
  from the graph unless a call asks for them;
* the saliency file: counts and REAP means recomputed from the model's own routing outputs, per
  tag and overall;
* the imatrix: llama.cpp's GGUF layout read back by gguf-py, consistent with the saliency counts
  (agreement with the real llama-imatrix: tests/interop/test_imatrix_llama.py);
* the command line: one-line errors and exit codes.
"""
from __future__ import annotations

import json
from functools import partial

import ggml
import numpy as np
import pytest
from gguf import GGUFReader, Keys

from gguf_arch.arch.tensors import ROUTED_EXPERTS, plan_tensors
from ggml_graph_spec.graph import taps
from ggml_graph_spec.blocks.moe import build_moe
from ggml_graph_spec.graph.cache import SequenceCache
from ggml_graph_spec.tools.calibrate import chunks_of, main, parse_file_arg
from ggml_graph_spec.backends.cpu import Executor
from ggml_graph_spec.graph.build import F32, I32, GraphBuild
from ggml_graph_spec.weights.loader import load_gguf
from ggml_graph_spec.blocks.forward import build_forward
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.text.tokenizer import BPETokenizer
from tests.ggml_graph_spec.blocks.test_blocks import (RTOL, RandomLayer, cfg, np_rmsnorm,  # noqa: F401
                                                       np_sigmoid, np_situ)
from tests.support.paths import CODE, PROSE

TAPS = (taps.MOE_NORMS, taps.IMATRIX)


# ---- the taps on one block, against numpy ------------------------------------------------------

def np_moe_taps(cfg, L: RandomLayer, x: np.ndarray):
    """Per token the selected experts (ascending), their latent output norms, and in_sum2 per weight."""
    k, E = cfg.num_experts_used, cfg.num_experts
    probs = np_sigmoid(x @ L("ffn_gate_inp.weight").T)
    picked = np.sort(np.argsort(-(probs + L("exp_probs_b.bias")), axis=1, kind="stable")[:, :k], axis=1)
    z = x @ L("ffn_routed_down.weight").T
    u, norms = np.zeros_like(z), np.zeros(picked.shape)
    sq_z, sq_h = np.zeros((E, z.shape[1])), np.zeros((E, cfg.moe_intermediate_size))
    for t in range(len(x)):
        w = probs[t, picked[t]] / probs[t, picked[t]].sum() * cfg.routed_scaling_factor
        for j, (e, we) in enumerate(zip(picked[t], w)):
            h = np_situ(L("ffn_gate_exps.weight")[e] @ z[t], L("ffn_up_exps.weight")[e] @ z[t],
                        cfg.situ_beta, cfg.situ_linear_beta)
            out = L("ffn_down_exps.weight")[e] @ h
            norms[t, j] = np.linalg.norm(out)
            sq_z[e] += z[t] ** 2
            sq_h[e] += h ** 2
            u[t] += we * out
    shexp = np_situ(x @ L("ffn_gate_shexp.weight").T, x @ L("ffn_up_shexp.weight").T, cfg.situ_beta,
                    cfg.situ_linear_beta)
    dense = {"ffn_gate_inp": x, "ffn_routed_down": x, "ffn_gate_shexp": x, "ffn_up_shexp": x,
             "ffn_down_shexp": shexp, "ffn_routed_up": np_rmsnorm(u, L("ffn_routed_norm.weight"), cfg.rms_norm_eps)}
    sums = {n: (a ** 2).sum(0)[None, :] for n, a in dense.items()}
    sums.update(ffn_gate_exps=sq_z, ffn_up_exps=sq_z, ffn_down_exps=sq_h)
    return picked, norms, sums


def _run_moe_with_taps(exe, cfg, L, x, exact):
    cache = SequenceCache(cfg, exe.backend, n_ctx=16, exact=exact, with_indexer=False)
    make = partial(GraphBuild, cfg=cfg, cache=cache, n_tokens=len(x), exact=exact, top_k=None,
                   wants=("moe", *TAPS))
    try:
        with exe.graph(8192, make) as g:
            out = build_moe(g, L.w, g.input("x", F32, tuple(reversed(x.shape)), x))
            exe.compute(g, [out])
            return {key: exe.read(t) for key, t in g.records.items()}
    finally:
        cache.free()


@pytest.mark.parametrize("exact", [True, False])
def test_moe_taps_match_numpy(cfg, exact):  # noqa: F811 - the module fixture of test_blocks
    """Exact path: every tap equals the numpy reference to the block test's fp32 tolerance. Fast
    path: the same routing and the same quantities to the MXFP4 path's 3% (test_blocks)."""
    exe = Executor(n_threads=1)
    layer = cfg.moe_layers[0]
    L = RandomLayer(cfg, layer, exe, seed=4)
    try:
        x = np.random.default_rng(5).standard_normal((7, cfg.hidden_size)).astype(np.float32)
        picked, norms, sums = np_moe_taps(cfg, L, x.astype(np.float64))
        rec = _run_moe_with_taps(exe, cfg, L, x, exact)
    finally:
        L.free()
        exe.free()
    rtol = RTOL if exact else 3e-2
    ids = rec[("moe_experts", layer)]
    order = np.argsort(ids, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, 1), picked)
    got_norms = np.take_along_axis(rec[(taps.MOE_NORMS, layer)], order, 1)
    assert np.abs(got_norms - norms).max() <= rtol * norms.max()
    for name, want in sums.items():
        got = rec[(taps.IMATRIX, f"blk.{layer}.{name}.weight")]
        assert got.shape == want.shape, name
        assert np.abs(got - want).max() <= rtol * np.abs(want).max(), name


# ---- the taps in the whole graph ----------------------------------------------------------------

def _graph_nodes(gguf, wants, exact: bool) -> list[tuple]:
    """(op, ne) of every node of the forward graph for 5 tokens, without computing it."""
    weights = load_gguf(gguf)
    exe = Executor(n_threads=1)
    cache = SequenceCache(weights.cfg, exe.backend, n_ctx=8, exact=exact, with_indexer=weights.cfg.indexer is not None)
    make = partial(GraphBuild, cfg=weights.cfg, cache=cache, n_tokens=5, exact=exact,
                   top_k=weights.cfg.indexer.top_k if weights.cfg.indexer else None, wants=wants)
    try:
        with exe.graph(1 << 16, make) as g:
            build_forward(g, weights, g.input("tokens", I32, (5,), np.arange(5, dtype=np.int32)))
            return [(n.contents.op, tuple(n.contents.ne)) for n in
                    (ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf)))]
    finally:
        cache.free()
        exe.free()
        weights.close()


@pytest.mark.parametrize("exact", [True, False])
def test_without_the_request_the_graph_has_no_tap(k31pro_tiny_gguf, monkeypatch, exact):
    """The taps are the only difference the request makes: never called without it, and with them
    silenced the requested graph is node for node the plain one."""
    plain_nodes = _graph_nodes(k31pro_tiny_gguf, (), exact)
    for f in ("record_input_sq", "record_expert_input_sq", "record_slot_norms"):
        monkeypatch.setattr(taps, f, lambda *a, f=f: pytest.fail(f"taps.{f} called without the request"))
    assert _graph_nodes(k31pro_tiny_gguf, (), exact) == plain_nodes
    for f in ("record_input_sq", "record_expert_input_sq", "record_slot_norms"):
        monkeypatch.setattr(taps, f, lambda *a: None)
    assert _graph_nodes(k31pro_tiny_gguf, TAPS, exact) == plain_nodes
    monkeypatch.undo()
    assert len(_graph_nodes(k31pro_tiny_gguf, TAPS, exact)) > len(plain_nodes)


@pytest.mark.parametrize("exact", [True, False])
def test_taps_do_not_change_the_logits(k31pro_tiny_gguf, exact):
    ids = list(range(3, 40))
    m = Model.load(k31pro_tiny_gguf, n_ctx=64, exact_experts=exact, n_threads=2)
    try:
        plain = m.eval(ids)
        m.reset()
        tapped = m.run(ids, want=TAPS)
    finally:
        m.close()
    np.testing.assert_array_equal(tapped.logits, plain)
    assert set(tapped.moe_norms) == set(tapped.moe_experts) == set(m.cfg.moe_layers)  # moe_norms brings "moe"


# ---- the saliency file -------------------------------------------------------------------------

CHUNK = 48


@pytest.fixture(scope="module")
def calibrated(k31pro_tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("calibrate")
    sal, im = out / "saliency.json", out / "imatrix.gguf"
    argv = ["-m", str(k31pro_tiny_gguf), "-f", f"{PROSE}:prose", "-f", f"{CODE}:code", "-o", str(sal),
            "--imatrix", str(im), "-c", str(CHUNK), "--chunks", "2", "-t", "2", "--exact-experts"]
    assert main(argv) == 0
    return json.loads(sal.read_text()), im


def _expected_stats(gguf) -> dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """Per tag and layer (count, sum of g * ||e||), from Model.run over the CLI's chunks."""
    tok = BPETokenizer.from_gguf(gguf)
    m = Model.load(gguf, n_ctx=CHUNK, exact_experts=True, n_threads=2)
    out: dict = {}
    try:
        for path, tag in ((PROSE, "prose"), (CODE, "code")):
            for chunk in chunks_of(tok.encode(path.read_text()), CHUNK, 2):
                m.reset()
                r = m.run(chunk, want=("moe", taps.MOE_NORMS))
                for layer, ids in r.moe_experts.items():
                    count, weighted = out.setdefault(tag, {}).setdefault(layer, (np.zeros(8), np.zeros(8)))
                    np.add.at(count, ids.ravel(), 1)
                    contribution = r.moe_weights[layer].astype(np.float64) * r.moe_norms[layer]
                    np.add.at(weighted, ids.ravel(), contribution.ravel())
    finally:
        m.close()
    return out


def test_saliency_is_the_mean_over_routed_tokens_per_tag(calibrated, k31pro_tiny_gguf):
    doc, _ = calibrated
    expected = _expected_stats(k31pro_tiny_gguf)
    assert doc["format"] == "kimi-k3-saliency/1" and doc["expert_count"] == 8
    assert doc["tokens"] == 4 * CHUNK == sum(f["tokens"] for f in doc["files"])
    assert [(f["tag"], f["chunks"]) for f in doc["files"]] == [("prose", 2), ("code", 2)]
    assert sorted(map(int, doc["layers"])) == list(range(1, 13))
    for key, entry in doc["layers"].items():
        total_count, total_weighted = np.zeros(8), np.zeros(8)
        for tag in ("prose", "code"):
            count, weighted = expected[tag][int(key)]
            got = entry["by_tag"][tag]
            np.testing.assert_array_equal(got["count"], count)
            mean = np.divide(weighted, count, out=np.zeros(8), where=count > 0)
            np.testing.assert_allclose(got["saliency"], mean, rtol=1e-12)
            total_count += count
            total_weighted += weighted
        np.testing.assert_array_equal(entry["count"], total_count)
        assert sum(entry["count"]) == 4 * CHUNK * 2  # every token routed to k = 2 experts
        np.testing.assert_allclose(entry["saliency"], np.divide(total_weighted, total_count, out=np.zeros(8),
                                                                where=total_count > 0), rtol=1e-12)


def test_the_file_argument_and_chunks():
    assert parse_file_arg("a/b.txt") == parse_file_arg("a/b.txt:b")
    assert parse_file_arg("a/b.txt:code").tag == "code"
    assert parse_file_arg(str(PROSE)).tag == "prose"
    assert chunks_of(list(range(10)), 4, -1) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert chunks_of(list(range(10)), 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ---- the imatrix ---------------------------------------------------------------------------------

def test_imatrix_is_llama_cpp_format_read_back_by_gguf_py(calibrated, k31pro_tiny_gguf):
    doc, im = calibrated
    r = GGUFReader(im)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert fields == {Keys.General.TYPE: "imatrix", Keys.IMatrix.DATASETS: [str(PROSE), str(CODE)],
                      Keys.IMatrix.CHUNK_COUNT: 4, Keys.IMatrix.CHUNK_SIZE: CHUNK}
    cfg = load_gguf(k31pro_tiny_gguf).cfg
    # every weight a matmul reads: the blk.* matrices and per-head 3-D weights (not the 4-D conv
    # kernels, vectors, norms or the globals)
    weights = sorted(p.name for p in plan_tensors(cfg) if p.layer is not None and len(p.shape) in (2, 3))
    assert [t.name for t in r.tensors] == [f"{w}.{s}" for w in weights for s in ("in_sum2", "counts")]
    t = {x.name: x for x in r.tensors}
    routed = {e.format(l=l) for l in cfg.moe_layers for e in ROUTED_EXPERTS}
    for w in weights:
        s, c = t[f"{w}.in_sum2"], t[f"{w}.counts"]
        assert s.tensor_type.name == c.tensor_type.name == "F32"
        assert np.all(s.data >= 0)
        if w in routed:
            layer = w.split(".")[1]
            assert list(c.shape) == [1, 8] and list(s.shape)[1:] == [8]
            np.testing.assert_array_equal(c.data.ravel(), doc["layers"][layer]["count"])
            assert not s.data[c.data.ravel() == 0].any()  # no token: no sum
        else:
            assert list(c.shape) == [1] and c.data[0] == 4 * CHUNK and len(s.shape) == 1
    same_input = [f"blk.5.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "ssm_beta", "ssm_f_a", "ssm_g")]
    for a in same_input[1:]:
        np.testing.assert_array_equal(t[f"{a}.in_sum2"].data, t[f"{same_input[0]}.in_sum2"].data)
    np.testing.assert_array_equal(t["blk.5.ffn_gate_exps.weight.in_sum2"].data,
                                  t["blk.5.ffn_up_exps.weight.in_sum2"].data)


# ---- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize("extra, code, says", [
    (["-c", "0"], 2, "-c/--ctx-size must be >= 1"),
    (["--chunks", "0"], 2, "--chunks must be >= 1"),
    (["-t", "0"], 2, "-t/--threads must be >= 1"),
    (["-f", "missing.txt"], 2, "missing.txt: no such calibration file"),
    (["--bogus"], 2, "unrecognized arguments"),
])
def test_bad_arguments_are_one_line_errors(k31pro_tiny_gguf, tmp_path, capsys, extra, code, says):
    argv = ["-m", str(k31pro_tiny_gguf), "-f", str(PROSE), "-o", str(tmp_path / "s.json"), *extra]
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not (tmp_path / "s.json").exists()


def test_outputs_never_replace_what_the_run_reads(k31pro_tiny_gguf, tmp_path, capsys):
    """The one output guard (gguf_arch/io/output_paths.py): -o over the model or a text it reads,
    or -o and --imatrix on one path, are refused before anything is written, even with --overwrite."""
    text = tmp_path / "t.txt"
    text.write_text(PROSE.read_text())
    before = text.read_bytes()
    for extra, says in ((["-o", str(text)], "which this run reads"),
                        (["-o", str(tmp_path / "s.json"), "--imatrix", str(tmp_path / "s.json")], "both")):
        assert main(["-m", str(k31pro_tiny_gguf), "-f", str(text), *extra, "--overwrite"]) == 2
        assert says in capsys.readouterr().err
    assert text.read_bytes() == before and not (tmp_path / "s.json").exists()


def test_existing_output_is_kept_without_overwrite(k31pro_tiny_gguf, tmp_path, capsys):
    out = tmp_path / "s.json"
    out.write_text("mine")
    assert main(["-m", str(k31pro_tiny_gguf), "-f", str(PROSE), "-o", str(out), "-c", "8", "--chunks", "1"]) == 1
    assert "already exists (use --overwrite" in capsys.readouterr().err
    assert out.read_text() == "mine"
    assert main(["-m", str(k31pro_tiny_gguf), "-f", str(PROSE), "-o", str(out), "-c", "8", "--chunks", "1",
                 "--overwrite"]) == 0
    assert json.loads(out.read_text())["tokens"] == 8


def test_a_model_that_is_not_a_gguf_is_bad_input(tmp_path, capsys):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"not a gguf")
    assert main(["-m", str(fake), "-f", str(PROSE), "-o", str(tmp_path / "s.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {fake}")


def test_a_text_shorter_than_a_chunk_is_one_chunk(k31pro_tiny_gguf, tmp_path):
    sal, im = tmp_path / "s.json", tmp_path / "im.gguf"
    assert main(["-m", str(k31pro_tiny_gguf), "-f", str(PROSE), "-o", str(sal), "--imatrix", str(im),
                 "-c", "1000"]) == 0
    n = len(BPETokenizer.from_gguf(k31pro_tiny_gguf).encode(PROSE.read_text()))
    doc = json.loads(sal.read_text())
    assert n < 1000 and doc["tokens"] == n and doc["files"][0]["chunks"] == 1
    r = GGUFReader(im)
    assert r.fields[Keys.IMatrix.CHUNK_COUNT].contents() == 1
    assert r.fields[Keys.IMatrix.CHUNK_SIZE].contents() == 1000
