"""The CPU kernels the project sets up and `repack`: ggml built with llamafile's sgemm (what
scripts/setup_env.sh asks for), and the routed experts in ggml's CPU_REPACK layout giving the
logits of the experts read from the mapped file."""
from __future__ import annotations

import ctypes
import subprocess
import sys

import ggml
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from ggml_graph_spec.engine.model import EvalError, Model
from tests.support.gguf_edit import rewritten_copy

from tests.support.reference import N_CTX, load_reference

# Both paths quantize the activations to Q8_0 blocks the same way and take the same integer block
# dot products; only the float accumulation of the block results runs in another order. ggml's
# MXFP4 kernels are its AVX2 ones on AVX2 and on AVX512 CPUs alike: the mapped dot product
# (ggml_vec_dot_mxfp4_q8_0) sums 8 lanes per block in two accumulators and a horizontal sum, up
# to 2 ulp from the exact sum on the fixture; the repacked 8x8 gemv one fused multiply-add per
# block, within 0.5 ulp. Such an ulp is mostly absorbed where the next matmul rounds its input
# (to Q8_0, or BF16), but not always: one that moves a Q8_0 block's scale or a value across a
# rounding step moves an expert's output by ~2^-11 relative, which the random fixture amplifies
# over the later layers (a 3-sequence decode on AVX2: 0.075 on logits of ~3; the mixed-batch test
# below checks that every sum is right to its rounding). On these prompts no rounding step is
# crossed: measured 0 on AVX512-BF16 CPUs and on an AVX2-only AMD EPYC. Any misplaced block (a
# wrong layout, an expert set from the wrong bytes) moves logits by O(1).
REPACK_ATOL = 1e-4


def test_ggml_is_built_with_llamafile_sgemm():
    """The prompt-speed target of bench/graph.py needs it: scripts/setup_env.sh builds ggml-python
    with -DGGML_LLAMAFILE=ON (the vendored ggml's own default is off)."""
    assert ggml.ggml_cpu_has_llamafile() == 1


def _load(gguf, **kw) -> Model:
    return Model.load(gguf, n_ctx=N_CTX, n_threads=2, **kw)


@pytest.mark.parametrize("prompt", ("short", "long"))
def test_repacked_experts_give_the_mapped_logits(k31pro_tiny_gguf, k31pro_tiny_dir, prompt):
    ref = load_reference(k31pro_tiny_dir)
    mapped, packed = _load(k31pro_tiny_gguf), _load(k31pro_tiny_gguf, repack=True)
    try:
        experts = [n for n in mapped.weights.tensors if n.endswith("_exps.weight")]
        if not packed.weights.repacked:
            pytest.skip("this CPU has no MXFP4 repack kernels in ggml (they need AVX2 or NEON dot product)")
        assert sorted(packed.weights.repacked) == sorted(experts)
        assert packed.weights.repacked_bytes == sum(ggml.ggml_nbytes(mapped.weights.tensors[n]) for n in experts)
        ids = ref[f"input_ids_{prompt}"]
        # a whole prompt (the repacked gemm) and then token by token (its gemv)
        for step in (len(ids), 1):
            mapped.reset()
            packed.reset()
            want = np.concatenate([mapped.eval(ids[i:i + step]) for i in range(0, len(ids), step)])
            got = np.concatenate([packed.eval(ids[i:i + step]) for i in range(0, len(ids), step)])
            assert np.abs(got - want).max() <= REPACK_ATOL, (step, np.abs(got - want).max())
            assert (got.argmax(1) == want.argmax(1)).all()
    finally:
        mapped.close()
        packed.close()


def _q8_0(x: np.ndarray) -> np.ndarray:
    """Rows x [rows, n] F32 as ggml's CPU turns a matmul's input into Q8_0 blocks (a copy to Q8_0
    takes the same conversion), dequantized exactly to float64."""
    rows, n = x.shape
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=3 * x.nbytes + 8 * ggml.ggml_tensor_overhead()
                                               + ggml.ggml_graph_overhead(), mem_buffer=None, no_alloc=False))
    try:
        src = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, n, rows)
        ctypes.memmove(ggml.ggml_get_data(src), np.ascontiguousarray(x, np.float32).ctypes.data, x.nbytes)
        dst = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_Q8_0, n, rows)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, ggml.ggml_cpy(ctx, src, dst))
        ggml.ggml_graph_compute_with_ctx(ctx, gf, 1)
        raw = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(dst), ctypes.POINTER(ctypes.c_uint8)),
                                    shape=(ggml.ggml_nbytes(dst),)).copy()
    finally:
        ggml.ggml_free(ctx)
    return dequantize(raw.reshape(rows, -1), Q.Q8_0).astype(np.float64)


def _recording_mul_mat_id(monkeypatch) -> dict:
    """Every ggml_mul_mat_id the graphs make (the routed experts) kept alive with its input and
    ids; returns graph context -> [(weight name, input, ids, output)], read by _read_calls."""
    calls: dict = {}
    real = ggml.ggml_mul_mat_id

    def recording(ctx, w, x, ids):
        out = real(ctx, w, x, ids)
        for t in (out, ids, x.contents.view_src or x):  # x is a reshape of a matmul's output
            ggml.ggml_set_output(t)
        calls.setdefault(ctx, []).append((ggml.ggml_get_name(w).decode(), x, ids, out))
        return out
    monkeypatch.setattr(ggml, "ggml_mul_mat_id", recording)
    return calls


def _read_calls(model: Model, calls: dict, into: list) -> None:
    """After each graph's compute, its mul_mat_id calls as arrays: x [T, n1, in], ids [T, k],
    out [T, k, out]."""
    compute, graph = model.executor.compute, model.executor.graph
    calls.clear()  # the graphs the load built to measure, never computed

    def building(*args, **kw):
        calls.clear()  # a context's address may be a freed one's
        return graph(*args, **kw)

    def computing(g, outputs):
        compute(g, outputs)
        for name, x, ids, out in calls.pop(g.ctx, []):
            xs, ks, os_ = x.contents.ne, ids.contents.ne, out.contents.ne
            into.append((name, model.executor.read(x).reshape(xs[2], xs[1], xs[0]),
                         model.executor.read(ids).reshape(ks[1], ks[0]),
                         model.executor.read(out).reshape(os_[2], os_[1], os_[0])))
    model.executor.compute, model.executor.graph = computing, building


def test_repacked_experts_in_a_mixed_batch_compute_the_mapped_sums_to_the_rounding(k31pro_tiny_gguf, monkeypatch):
    """The mixed batch of test_sequences.py (3 sequences, one with a history, prefilled together,
    then 3 greedy steps) mapped and repacked. Their logits may differ (on AVX2 sequence 0's decode
    by up to 0.075): an ulp of one sum moved a Q8_0 scale of the next matmul's input by a step
    (REPACK_ATOL's comment). What must hold is that both compute the right sums:

    * every routed-expert output of both runs (gate, up, down; every token, slot and layer) is
      within the float rounding of the exact sum of the integer block products it stands for:
      the MXFP4 weight of the selected expert in the GGUF times its input as ggml's Q8_0 blocks.
      The kernels add N = 8 x blocks exact terms at most (the dot product: 8 lane sums a block
      times its scale, within float32's 24 bits; the gemv: a block's sum times its scale, which
      its fused multiply-add does not round), and any order of adding N terms is within
      N x 2^-24 x (the sum of their magnitudes, at most sum |w x|) of the exact sum. Measured:
      both within 0.08 of that bound; an expert set from another's bytes is ~10^6 times over it;
    * the experts reach the rest of the model through their down projection's output alone: up
      to the first down output that differs between the runs (on AVX2: layer 8 of the first
      decode step), every layer's routing and gate/up input are the same bits in both, that
      layer's included; so the difference starts in the experts' rounding, never in the routing
      or in another weight. Without such an output the logits are the same bits."""
    from tests.ggml_graph_spec.test_sequences import _greedy, _options, _prompts
    calls = _recording_mul_mat_id(monkeypatch)
    runs, logits = {}, {}
    for repack in (False, True):
        m = Model.load(k31pro_tiny_gguf, _options("k31pro", False, "gather", n_seq=3, repack=repack))
        try:
            if repack and not m.weights.repacked:
                pytest.skip("this CPU has no MXFP4 repack kernels in ggml (they need AVX2 or NEON dot product)")
            assert bool(m.weights.repacked) is repack
            runs[repack] = []
            _read_calls(m, calls, runs[repack])
            m.decode({2: _prompts(1)[2]})
            logits[repack] = _greedy(m, _prompts(), steps=3)
        finally:
            m.close()
    mapped, packed = runs[False], runs[True]
    assert [c[0] for c in mapped] == [c[0] for c in packed] and len(mapped) == 5 * 3 * 12  # 5 graphs, 12 MoE layers

    weights = {t.name: dequantize(t.data, Q.MXFP4).astype(np.float64)  # [expert, out, in]
               for t in GGUFReader(k31pro_tiny_gguf).tensors if t.name.endswith("_exps.weight")}
    for run in (mapped, packed):
        for name, x, ids, out in run:
            T, n1, n_in = x.shape
            xq = _q8_0(x.reshape(T * n1, n_in)).reshape(T, n1, n_in)
            w = weights[name][ids]  # [T, k, out, in]
            xs = xq[np.arange(T)[:, None], np.arange(ids.shape[1]) % n1]  # each slot's input [T, k, in]
            exact = np.einsum("tkoi,tki->tko", w, xs)
            bound = 8 * (n_in // 32) * 2.0 ** -24 * np.einsum("tkoi,tki->tko", np.abs(w), np.abs(xs))
            assert (np.abs(out - exact) <= bound).all(), (name, np.abs(out - exact).max(), bound.max())
    # The experts reach the rest of the model through their down projection's output only.
    down = [i for i, c in enumerate(mapped) if c[0].endswith("ffn_down_exps.weight")]
    first = next((i for i in down if not np.array_equal(mapped[i][3], packed[i][3])), None)
    if first is None:
        for s in logits[False]:
            np.testing.assert_array_equal(logits[True][s], logits[False][s])
        return
    for (name, x, ids, _), (_, px, pids, _) in zip(mapped[:first + 1], packed[:first + 1]):
        assert np.array_equal(ids, pids), name
        if not name.endswith("ffn_down_exps.weight"):
            assert np.array_equal(x, px), name


def test_repack_leaves_what_ggml_cannot_repack_in_the_file(k31pro_tiny_gguf, tmp_path):
    """One expert tensor F32 (as --requantize-experts f32 writes it): ggml has no repacked layout
    for F32, so that one stays mapped, the others are repacked, and the logits are those of the
    same GGUF with nothing repacked."""
    name = "blk.1.ffn_up_exps.weight"
    t = next(t for t in GGUFReader(k31pro_tiny_gguf).tensors if t.name == name)
    f32 = dequantize(t.data, Q.MXFP4).astype(np.float32)
    gguf = rewritten_copy(k31pro_tiny_gguf, tmp_path / "mixed.gguf", replace={name: (f32, Q.F32)})
    mapped, packed = _load(gguf), _load(gguf, repack=True)
    try:
        if not packed.weights.repacked:
            pytest.skip("this CPU has no MXFP4 repack kernels in ggml")
        assert name not in packed.weights.repacked
        assert packed.weights.tensors[name].contents.type == Q.F32
        assert len(packed.weights.repacked) == sum(n.endswith("_exps.weight") for n in mapped.weights.tensors) - 1
        ids = list(range(1, 40))
        want, got = mapped.eval(ids), packed.eval(ids)
        assert np.abs(got - want).max() <= REPACK_ATOL
        assert (got.argmax(1) == want.argmax(1)).all()
    finally:
        mapped.close()
        packed.close()


def test_repack_is_refused_on_the_exact_path(k31pro_tiny_gguf, capsys):
    with pytest.raises(EvalError, match="fast path"):
        _load(k31pro_tiny_gguf, repack=True, exact_experts=True)
    from ggml_graph_spec.runner.cli import main
    assert main(["-m", str(k31pro_tiny_gguf), "-p", "x", "--repack", "--exact-experts"]) == 2
    assert "--repack applies to the fast path" in capsys.readouterr().err


def _run(gguf, *flags: str, n: int = 1) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "ggml_graph_spec", "-m", str(gguf), "-p", "x", "-n", str(n), "--temp", "0",
                        "-c", "32", "-t", "2", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def _info(gguf, *flags: str) -> str:
    """The print_info line of the CPU kernels, of a run with `flags`."""
    return _kernels(_run(gguf, *flags).stderr)


def _kernels(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if "ggml CPU" in line)


def test_cli_reports_the_kernels_and_keeps_ggml_debug_lines_out(k31pro_tiny_gguf):
    r = _run(k31pro_tiny_gguf, "--repack", n=2)
    info = _kernels(r.stderr)
    assert "llamafile sgemm on" in info and ("expert tensors repacked" in info or "none repacked" in info)
    # ggml logs one DEBUG line per repacked tensor; ggml_graph_spec's logger drops DEBUG
    assert "repack tensor" not in r.stderr


def _can_repack(gguf) -> bool:
    m = _load(gguf, repack=True)
    try:
        return bool(m.weights.repacked)
    finally:
        m.close()


def test_default_repacks_a_gguf_that_fits_as_llama_cpp_does(k31pro_tiny_gguf):
    """llama.cpp repacks by default (-nr turns it off); so do we where the GGUF fits in memory."""
    if not _can_repack(k31pro_tiny_gguf):
        pytest.skip("this CPU has no MXFP4 repack kernels in ggml")
    info = _info(k31pro_tiny_gguf)
    assert "expert tensors repacked" in info and "(default: the " in info and "fits in" in info, info
    m = _load(k31pro_tiny_gguf)
    try:
        assert m.weights.repacked and m.weights.repack_why.startswith("default:")
    finally:
        m.close()
    for flag in ("-nr", "--no-repack"):
        assert _info(k31pro_tiny_gguf, flag).endswith("weights mapped from the file, none repacked")
    forced = _info(k31pro_tiny_gguf, "--repack")
    assert "expert tensors repacked (" in forced and forced.endswith(" (--repack)"), forced


@pytest.mark.parametrize("kw", [{"exact_experts": True}, {"mem_budget": "64M"}], ids=["exact", "mem-budget"])
def test_default_reads_the_experts_from_the_file_where_they_are_streamed_or_exact(k31pro_tiny_gguf, kw):
    """The exact path and --mem-budget read the experts from the file: the default does not
    repack there (and does not refuse to load, as an explicit repack would)."""
    m = _load(k31pro_tiny_gguf, **kw)
    try:
        assert m.weights.repacked == () and m.weights.repack_why == ""
    finally:
        m.close()
    info = _info(k31pro_tiny_gguf, *(["--exact-experts"] if "exact_experts" in kw else ["--mem-budget", "64M"]))
    assert "none repacked" in info


@pytest.mark.parametrize("usable,expected", [(100 << 20, True), (50 << 20, False)])
def test_default_repacks_only_what_fits_in_usable_memory(monkeypatch, usable, expected):
    """The rule: the GGUF within MODEL_SHARE of the usable memory (RAM available, cgroup limit)."""
    from ggml_graph_spec.weights import repack
    monkeypatch.setattr(repack, "usable_memory", lambda: usable)
    size = int(repack.MODEL_SHARE * (60 << 20))
    chosen, why = repack.choose_repack(size)
    assert chosen is expected
    assert ("-nr keeps them mapped" if expected else "--repack forces it") in why
    assert repack.choose_repack(int(repack.MODEL_SHARE * usable))[0] is True
    assert repack.choose_repack(int(repack.MODEL_SHARE * usable) + 1)[0] is False
