"""llama.cpp (llama-cpp-python 0.3.36, the `interop` extra) and the GGUFs it is given.

Every test here is skipped, with the reason, when llama_cpp cannot be imported (each module
carries `pytestmark = requires_llama_cpp`). llama.cpp's own log goes through a callback that
keeps it out of the test output and lets a test read what llama.cpp said (the only place its
load errors are spelled out).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

import convert_kimi_k3

try:
    import llama_cpp
    import llama_cpp._ggml  # llama-cpp-python's ctypes handle on its own ggml
except (ImportError, OSError) as exc:  # OSError: the wheel's shared libraries failed to load
    llama_cpp = None
    _MISSING = f"llama_cpp cannot be imported ({exc}); install the 'interop' extra"
else:
    _MISSING = ""

requires_llama_cpp = pytest.mark.skipif(llama_cpp is None, reason=_MISSING)

GGML_TYPE_F32 = 0  # ggml.h enum ggml_type; type_k / type_v of a llama.cpp context
GGML_LOG_LEVEL_ERROR = 4


class LlamaLog:
    """Collects llama.cpp's log lines instead of printing them."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []
        # ctypes must keep the callback object alive as long as llama.cpp may call it.
        self._callback = llama_cpp.llama_log_callback(self._collect)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _collect(self, level: int, text: bytes, _user_data) -> None:
        self.lines.append((level, text.decode("utf-8", errors="replace")))

    def errors(self) -> list[str]:
        return [t.strip() for level, t in self.lines if level == GGML_LOG_LEVEL_ERROR]


@pytest.fixture(scope="session", autouse=True)
def llama_log() -> LlamaLog | None:
    """Installed before any test here runs, so no llama.cpp call prints."""
    return LlamaLog() if llama_cpp is not None else None


@pytest.fixture
def load_llama(llama_log):
    """load_llama(path, **kw) -> llama_cpp.Llama on 2 threads with all logits kept; closed afterwards."""
    opened = []

    def load(path: Path, **kw) -> "llama_cpp.Llama":
        args = dict(n_ctx=128, n_batch=128, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
        llm = llama_cpp.Llama(model_path=str(path), **{**args, **kw})
        opened.append(llm)
        return llm

    yield load
    for llm in opened:
        llm.close()


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits [len(ids), vocab] from an empty cache."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


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


def llama_named_outputs(path: Path, ids: list[int], names: set[str]) -> dict[str, np.ndarray]:
    """The F32 graph tensors llama.cpp names `names` (e.g. "l_out-3"), read with the eval callback
    while it decodes `ids` in one batch. Flat float32 arrays, in ggml's memory order."""
    ggml = llama_cpp._ggml.libggml
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_nbytes.restype = ctypes.c_size_t
    ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    got: dict[str, np.ndarray] = {}

    def collect(tensor, ask, _user_data) -> bool:
        name = ggml.ggml_get_name(tensor).decode()
        if ask:
            return name in names
        out = np.empty(ggml.ggml_nbytes(tensor) // 4, dtype=np.float32)
        ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
        got[name] = out
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(collect)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = max(32, len(ids))
    cp.n_threads = cp.n_threads_batch = 2
    cp.cb_eval = callback
    ctx = llama_cpp.llama_init_from_model(model, cp)
    try:
        tokens = (llama_cpp.llama_token * len(ids))(*ids)
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, len(ids))) == 0
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return got
