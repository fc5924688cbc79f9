"""The CPU kernels the project sets up and `repack`: ggml built with llamafile's sgemm (what
scripts/setup_env.sh asks for), and the routed experts in ggml's CPU_REPACK layout giving the
logits of the experts read from the mapped file."""
from __future__ import annotations

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
# dot products; only the float accumulation of the block results may run in another order (8
# interleaved rows at a time). That is f32 rounding, ~1e-7 relative per dot product; over 13
# layers it stays far below 1e-4 on logits of magnitude ~10 (measured: 0 on the fixtures), while
# any misplaced block (a wrong layout, an expert set from the wrong bytes) moves logits by O(1).
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
