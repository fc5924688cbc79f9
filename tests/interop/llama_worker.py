"""Runs llama.cpp (llama-cpp-python) calls in a process of their own; the tests' side is
`conftest.llama_run`.

Why a separate process: ggml-python and llama-cpp-python each load their own ggml (0.15.3 and
0.25.3) with RTLD_GLOBAL, so in one process the library loaded second binds to the first one's
ggml symbols; with ggml-python loaded first, llama.cpp segfaults while loading a model. This
file imports llama_cpp and numpy only.

    python llama_worker.py REQUEST.pickle RESULT.pickle

REQUEST: {"model": path, "params": Llama kwargs, "calls": [(name, *args), ...]}. RESULT: a list
with one result per call, or {"load_error": message, "log_errors": [...]} when the model does
not load.
"""
from __future__ import annotations

import ctypes
import pickle
import sys
from pathlib import Path

import llama_cpp
import llama_cpp._ggml  # llama-cpp-python's ctypes handle on its own ggml
import numpy as np

GGML_LOG_LEVEL_ERROR = 4
_log: list[tuple[int, str]] = []


@llama_cpp.llama_log_callback
def _collect(level: int, text: bytes, _user_data) -> None:
    # Keeps llama.cpp's log out of the output; its load errors are only spelled out here.
    _log.append((level, text.decode("utf-8", errors="replace")))


def logits(llm, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits [len(ids), vocab] from an empty cache."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def greedy(llm, ids: list[int], n: int) -> list[int]:
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


def tokenize(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def detokenize(llm, ids: list[int]) -> bytes:
    return llm.detokenize(ids, special=True)


def metadata(llm) -> dict:
    return {"metadata": dict(llm.metadata), "n_vocab": llm.n_vocab()}


def named_outputs(llm, ids: list[int], names: list[str]) -> dict[str, np.ndarray]:
    """The F32 graph tensors llama.cpp names `names` (e.g. "l_out-0"), read with the eval callback
    of a fresh context while it decodes `ids` in one batch; flat, in ggml's memory order."""
    ggml = llama_cpp._ggml.libggml
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_nbytes.restype = ctypes.c_size_t
    ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    wanted, got = set(names), {}

    def collect(tensor, ask, _user_data) -> bool:
        name = ggml.ggml_get_name(tensor).decode()
        if ask:
            return name in wanted
        out = np.empty(ggml.ggml_nbytes(tensor) // 4, dtype=np.float32)
        ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
        got[name] = out
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(collect)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = max(32, len(ids))
    cp.n_threads = cp.n_threads_batch = llm.n_threads
    cp.flash_attn_type = llm.context_params.flash_attn_type  # the Llama's setting, not the default
    cp.cb_eval = callback
    ctx = llama_cpp.llama_init_from_model(llm.model, cp)
    try:
        tokens = (llama_cpp.llama_token * len(ids))(*ids)
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")
    finally:
        llama_cpp.llama_free(ctx)
    return got


def cpu_features(_llm, names: list[str]) -> dict[str, int]:
    """ggml_cpu_has_<name>() of llama.cpp's own ggml CPU backend, for each name."""
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).with_name("lib") / "libggml-cpu.so"))
    return {name: getattr(lib, f"ggml_cpu_has_{name}")() for name in names}


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _ggml_api():
    """llama.cpp's own ggml (base and CPU backend) with the few signatures fused_attn_res_mix needs."""
    base = llama_cpp._ggml.libggml
    cpu = ctypes.CDLL(str(Path(llama_cpp.__file__).with_name("lib") / "libggml-cpu.so"))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for lib, name, res, args in ((base, "ggml_init", p, [_InitParams]), (base, "ggml_free", None, [p]),
                                 (base, "ggml_new_tensor_2d", p, [p, ctypes.c_int, i64, i64]),
                                 (base, "ggml_new_tensor_3d", p, [p, ctypes.c_int, i64, i64, i64]),
                                 (base, "ggml_dsv4_hc_pre", p, [p, p, p]), (base, "ggml_new_graph", p, [p]),
                                 (base, "ggml_build_forward_expand", None, [p, p]), (base, "ggml_get_data", p, [p]),
                                 (cpu, "ggml_graph_compute_with_ctx", ctypes.c_int, [p, p, ctypes.c_int])):
        getattr(lib, name).restype, getattr(lib, name).argtypes = res, args
    return base, cpu


def fused_attn_res_mix(_llm) -> bool:
    """Whether llama.cpp's ggml_dsv4_hc_pre (its AttnRes mix: sum = 0; sum += x*w per candidate)
    was compiled into fused multiply-adds, a compiler's choice. Computed on x = [-1, 1 + 2^-12],
    w = [1 + 2^-11, 1 + 2^-12]: x1*w1 = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11, so the unfused sum
    is 0 and the fused one 2^-24."""
    base, cpu = _ggml_api()
    ctx = base.ggml_init(_InitParams(1 << 20, None, False))
    try:
        x, w = base.ggml_new_tensor_3d(ctx, 0, 1, 2, 1), base.ggml_new_tensor_2d(ctx, 0, 2, 1)  # 0: GGML_TYPE_F32
        for t, values in ((x, [-1.0, 1 + 2**-12]), (w, [1 + 2**-11, 1 + 2**-12])):
            ctypes.memmove(base.ggml_get_data(t), (ctypes.c_float * 2)(*values), 8)
        out = base.ggml_dsv4_hc_pre(ctx, x, w)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        if cpu.ggml_graph_compute_with_ctx(ctx, graph, 1) != 0:
            raise RuntimeError("ggml_graph_compute_with_ctx failed")
        return ctypes.c_float.from_address(base.ggml_get_data(out)).value != 0.0
    finally:
        base.ggml_free(ctx)


CALLS = {f.__name__: f for f in (logits, greedy, tokenize, detokenize, metadata, named_outputs, cpu_features,
                                 fused_attn_res_mix)}


def main(request_path: str, result_path: str) -> None:
    with open(request_path, "rb") as f:
        request = pickle.load(f)
    llama_cpp.llama_log_set(_collect, ctypes.c_void_p(0))
    try:
        llm = llama_cpp.Llama(model_path=request["model"], verbose=False, **request["params"])
    except ValueError as exc:
        result = {"load_error": str(exc),
                  "log_errors": [t.strip() for level, t in _log if level == GGML_LOG_LEVEL_ERROR]}
    else:
        result = [CALLS[name](llm, *args) for name, *args in request["calls"]]
        llm.close()
    with open(result_path, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
