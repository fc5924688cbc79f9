"""bench/graph.py's own parts: the CPU features it records, the plot step without matplotlib,
and the per-op profiler (bench/op_profile.py), which must compute what the whole graph computes."""
from __future__ import annotations

import sys

import numpy as np

from bench import op_profile
from bench.graph import CPU_FLAGS, cpu_features, plot
from ggml_graph_spec.engine.model import Model

from tests.support.reference import N_CTX, load_reference

CPUINFO = """processor\t: 0
model name\t: Some CPU
flags\t\t: fpu sse avx avx2 fma f16c avx512f avx512_bf16 lm
"""


def test_cpu_features_names_the_model_and_the_kernel_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    got = cpu_features(info)
    assert got["model_name"] == "Some CPU"
    assert got["flags"] == ["avx512_bf16", "avx512f", "avx2", "fma", "f16c", "avx"]
    assert set(got["flags"]) <= set(CPU_FLAGS)


def test_cpu_features_without_cpuinfo_are_empty(tmp_path):
    assert cpu_features(tmp_path / "missing") == {"model_name": None, "flags": []}


def test_plot_without_matplotlib_is_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "graph.png"
    plot({"contexts": [1024]}, out)
    assert not out.exists()
    assert "plot skipped: matplotlib is not installed" in capsys.readouterr().err


def test_per_op_profile_computes_the_same_logits(k31pro_tiny_gguf, k31pro_tiny_dir):
    ids = load_reference(k31pro_tiny_dir)["input_ids_long"][:12]
    logits, records = {}, []
    for profiled in (False, True):
        m = Model.load(k31pro_tiny_gguf, n_ctx=N_CTX, top_k=4, n_threads=1)
        try:
            if profiled:
                with op_profile.profiling(records):
                    logits[profiled] = np.concatenate([m.eval(ids[:8]), m.eval(ids[8:9])])
            else:
                logits[profiled] = np.concatenate([m.eval(ids[:8]), m.eval(ids[8:9])])
        finally:
            m.close()
    np.testing.assert_array_equal(logits[True], logits[False])
    ops = op_profile.per_op(records[1:])  # the decode step (one graph per eval)
    assert "SOFT_MAX" in ops and "MUL_MAT" in ops  # the gathered DSA attention (the default) and all(v >= 0 for v in ops.values())
    assert list(ops.values()) == sorted(ops.values(), reverse=True)


def test_kernel_times_cover_every_path_and_kernel(k31pro_tiny_gguf):
    from bench.graph import KERNEL_TIMINGS, PATHS, kernel_ops, kernel_times
    models = {p: Model.load(k31pro_tiny_gguf, n_ctx=N_CTX, n_threads=1, dsa=p != "dense",
                            dsa_path=None if p == "dense" else p) for p in PATHS}
    try:
        got = kernel_times(models, [16, 64])
        ops = kernel_ops(models["masked"], [64])
    finally:
        for m in models.values():
            m.close()
    assert got["top_k"] == [2, 8]
    for p in PATHS:
        for key in KERNEL_TIMINGS:
            assert len(got[p][key]) == 2 and all(v > 0 for v in got[p][key])
    assert "FLASH_ATTN_EXT" in ops["masked"][0]["ops_s"] and "FLASH_ATTN_EXT" not in ops["gather"][0]["ops_s"]
    assert {"GET_ROWS", "MUL_MAT", "SOFT_MAX"} <= set(ops["gather"][0]["ops_s"])
