"""llama.cpp (llama-cpp-python 0.3.36, the `interop` extra) and the GGUFs it is given.

llama.cpp runs in a child process (llama_worker.py says why: two ggml builds cannot share one
process). Every test here is skipped, with the reason, when llama_cpp cannot be imported there
(each module carries `pytestmark = requires_llama_cpp`). llama.cpp's log never reaches the test
output; the worker returns its error lines when a model does not load.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import convert_kimi_k3
import ggml

WORKER = Path(__file__).with_name("llama_worker.py")
GGML_TYPE_F32 = 0  # ggml.h enum ggml_type; type_k / type_v of a llama.cpp context
DEFAULT_PARAMS = dict(n_ctx=128, n_batch=128, n_threads=2, n_threads_batch=2, logits_all=True)


def _import_problem() -> str:
    r = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True)
    if r.returncode == 0:
        return ""
    last = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
    return f"llama_cpp cannot be imported ({last}); install the 'interop' extra"


_PROBLEM = _import_problem()
requires_llama_cpp = pytest.mark.skipif(bool(_PROBLEM), reason=_PROBLEM)


@dataclass
class LoadFailure:
    """What llama.cpp said when the model did not load."""

    message: str  # the Python exception of llama-cpp-python
    log_errors: list[str]  # llama.cpp's error-level log lines


def llama_run(model: Path, calls: list[tuple], tmp_path: Path, **params: Any) -> list[Any] | LoadFailure:
    """Load `model` in llama.cpp with DEFAULT_PARAMS updated by `params` and make the worker's
    calls, e.g. ("logits", ids), ("greedy", ids, 16), ("tokenize", text): one result per call."""
    request, result = tmp_path / "llama-request.pickle", tmp_path / "llama-result.pickle"
    request.write_bytes(pickle.dumps({"model": str(model), "params": {**DEFAULT_PARAMS, **params},
                                      "calls": calls}))
    r = subprocess.run([sys.executable, str(WORKER), str(request), str(result)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"llama worker exited with {r.returncode}: {r.stderr[-2000:]}"
    out = pickle.loads(result.read_bytes())
    return LoadFailure(out["load_error"], out["log_errors"]) if isinstance(out, dict) else out


# What ggml's CPU kernels are compiled for: the last bit of an op's result depends on it.
CPU_FEATURES = ("avx", "avx2", "fma", "f16c", "bmi2", "avx512", "avx512_vbmi", "avx512_vnni", "avx512_bf16",
                "llamafile")


@dataclass
class Kernels:
    """How llama.cpp's ggml kernels compare with ggml-python's, to the last bit.

    Two things can differ: the CPU features the two ggml builds target, and llama.cpp's AttnRes
    mix (ggml_dsv4_hc_pre, an op ggml 0.15.3 does not have; our graph multiplies and adds, which
    no compiler fuses across ops) when its compiler fused that loop's multiply-adds. GCC 12 fuses
    it with generic x86-64, x86-64-v3 and Intel -march tunings, not with AMD Zen ones
    (-march=native on this project's EPYC machines); clang fuses by default.
    """

    feature_mismatch: str  # '' or which features differ
    fused_mix: bool  # llama.cpp's mix rounds once per multiply-add (1 ulp against ours)

    @property
    def same(self) -> bool:
        return not self.feature_mismatch and not self.fused_mix

    def skip_unless_same(self) -> None:
        """Bit equality with llama.cpp is a claim about two builds of the same kernels."""
        why = [self.feature_mismatch] if self.feature_mismatch else []
        if self.fused_mix:
            why.append("llama.cpp's ggml_dsv4_hc_pre fuses its multiply-adds: 1 ulp against our mul + add in "
                       "AttnRes mixes of 3 or more candidates")
        if why:
            pytest.skip(f"the two runtimes' kernels differ in the last bit here ({'; '.join(why)})")


@pytest.fixture(scope="session")
def llama_kernels(k3_tiny_gguf, tmp_path_factory) -> Kernels:
    fused, theirs = llama_run(k3_tiny_gguf, [("fused_attn_res_mix",), ("cpu_features", list(CPU_FEATURES))],
                              tmp_path_factory.mktemp("llama"))
    ours = {name: getattr(ggml, f"ggml_cpu_has_{name}")() for name in CPU_FEATURES}
    return Kernels("; ".join(f"{n}: ggml-python {ours[n]}, llama.cpp {theirs[n]}"
                             for n in CPU_FEATURES if ours[n] != theirs[n]), fused)


def _convert(tmp_path_factory, model_dir: Path, name: str, *flags: str) -> Path:
    out = tmp_path_factory.mktemp("interop") / name
    assert convert_kimi_k3.main([str(model_dir), str(out), "--quiet", *flags]) == 0
    return out


@pytest.fixture(scope="session")
def k31pro_no_dsa_gguf(tmp_path_factory, k31pro_tiny_dir) -> Path:
    return _convert(tmp_path_factory, k31pro_tiny_dir, "k31pro-no-dsa.gguf", "--no-dsa")


@pytest.fixture(scope="session")
def k3_f32_gguf(tmp_path_factory, k3_tiny_dir) -> Path:
    """Every matrix and the routed experts in F32: nothing for llama.cpp to quantize on the fly."""
    return _convert(tmp_path_factory, k3_tiny_dir, "k3-f32.gguf", "--outtype", "f32", "--requantize-experts", "f32")


@pytest.fixture(scope="session")
def k31pro_no_dsa_f32_gguf(tmp_path_factory, k31pro_tiny_dir) -> Path:
    """The --no-dsa GGUF with every matrix and the routed experts in F32."""
    return _convert(tmp_path_factory, k31pro_tiny_dir, "k31pro-no-dsa-f32.gguf", "--no-dsa", "--outtype", "f32",
                    "--requantize-experts", "f32")
