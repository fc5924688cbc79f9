"""The measurements of bench/long_context.py (its docstring says what each one is and why)."""
from __future__ import annotations

import ctypes
import sys
import time
from functools import partial
from pathlib import Path

import ggml
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from ggml_graph_spec.backends.cpu import Executor
from ggml_graph_spec.blocks import mla
from ggml_graph_spec.engine import state as st
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.engine.options import CACHE_TYPES, INDEXER_CACHE_TYPES, LATENT_CACHE_TYPES
from ggml_graph_spec.graph.build import F32, GraphBuild
from ggml_graph_spec.graph.cache import cache_sizes
from ggml_graph_spec.graph.ubatch import UBatch

REPO = Path(__file__).resolve().parents[1]
TEXTS = sorted((REPO / "tests" / "fixtures" / "text").glob("*.txt"))
NOISE = 0.05
KINDS = ("indexer q.k", "indexer sum over heads", "top-k and masks", "attention", "rest")
# gguf-py's own encoders of each cache type (the bytes ggml's rows hold)
_ENCODE = {"f32": lambda r: r.astype(np.float32), "f16": lambda r: r.astype(np.float16),
           "bf16": lambda r: quantize(r, GGMLQuantizationType.BF16),
           "q8_0": lambda r: quantize(r, GGMLQuantizationType.Q8_0)}


def text_tokens(m: Model, n: int) -> list[int]:
    """n tokens of the repository's sample texts, repeated."""
    ids: list[int] = []
    while len(ids) < n:
        for path in TEXTS:
            ids += m.tokenizer.encode(path.read_text())
    return ids[:n]


def load(gguf: Path, path: str, n_ctx: int, threads: int, top_k: int, **kw) -> Model:
    dsa = dict(dsa=False) if path == "dense" else dict(dsa_path=path, top_k=top_k)
    return Model.load(gguf, n_ctx=n_ctx, n_threads=threads, repack=False, **dsa, **kw)


def prefill(gguf: Path, n: int, threads: int) -> st.SeqState:
    """The fast path's state after n tokens of text, with F32 caches (every cache type is made
    from these rows: bench/long_context.py)."""
    m = Model.load(gguf, n_ctx=n, n_threads=threads, repack=False, cache_type_k="f32", cache_type_indexer="f32")
    try:
        m.decode({0: text_tokens(m, n)})
        return st.decode(m.state_get(0), "prefill")
    finally:
        m.close()


def long_state(m: Model, base: st.SeqState, n: int, seed: int = 0) -> bytes:
    """A state of n tokens for m: the base rows, then copies with noise (the bench's docstring),
    in m's cache types."""
    rng = np.random.default_rng(seed)
    types, parts = m.options.cache_types(), []
    for kind, data in base.parts:
        if kind == "indexer" and not m.cache.with_indexer:
            continue
        if kind in ("latent", "indexer"):
            rows = np.frombuffer(data, np.float32).reshape(len(base.tokens), -1)
            copies = [rows] + [rows + NOISE * rows.std(1, keepdims=True) * rng.standard_normal(rows.shape, np.float32)
                               for _ in range(-(-n // len(rows)) - 1)]
            data = np.ascontiguousarray(_ENCODE[types[kind]](np.concatenate(copies)[:n])).tobytes()
        parts.append((kind, data))
    tokens = (base.tokens * (-(-n // len(base.tokens))))[:n]
    cache_types = {"latent": types["latent"], "indexer": types["indexer"] if m.cache.with_indexer else None}
    return st.encode(st.SeqState(m.identity, cache_types, tokens, parts))


def decode_times(models: dict, steps: int) -> dict:
    """Seconds of `steps` greedy decode steps per model (one thread each), the models taking
    turns: {"cpu": the calling thread's CPU time, which on one thread is the whole step (graph
    build and compute) and which other processes' load does not inflate; "wall": wall clock}."""
    times: dict = {p: {"cpu": [], "wall": []} for p in models}
    nxt = {p: 1 for p in models}
    for _ in range(steps):
        for p, m in models.items():
            c, t = time.thread_time(), time.perf_counter()
            logits = m.decode({0: [nxt[p]]})[0]
            times[p]["wall"].append(time.perf_counter() - t)
            times[p]["cpu"].append(time.thread_time() - c)
            nxt[p] = int(logits.argmax())
    return times


def _kind(op: str, ne: tuple, n_kv: int, h_i: int, top_k: int | None) -> str:
    """Which part of a decode step a node is, by its op and shape (one query)."""
    if op in ("MUL_MAT", "RELU") and ne[:2] == (h_i, n_kv):
        return "indexer q.k"
    if op == "MUL_MAT" and ne[0] == n_kv:
        return "indexer sum over heads"
    if op in ("TOP_K", "ARGSORT", "ARGMAX") or (n_kv in ne[:2] and op not in ("FLASH_ATTN_EXT",)):
        return "top-k and masks"
    if op in ("FLASH_ATTN_EXT", "SOFT_MAX", "GET_ROWS") or (op in ("MUL_MAT", "CPY") and top_k in ne[:3]):
        return "attention"
    return "rest"


def _profiled(m: Model, records: list) -> None:
    """One decode step on one thread, node by node (op, ne, CPU seconds)."""
    def run(self: Executor, g) -> int:
        rec = []
        for i in range(ggml.ggml_graph_n_nodes(g.gf)):
            one, node = ggml.ggml_graph_view(g.gf, i, i + 1), ggml.ggml_graph_node(g.gf, i)
            t = time.thread_time()
            ggml.ggml_backend_graph_compute(self.backend, ctypes.pointer(one))
            rec.append((ggml.ggml_op_desc(node).decode(), tuple(node.contents.ne[:4]), time.thread_time() - t))
        records.append(rec)
        return ggml.GGML_STATUS_SUCCESS
    plain = Executor._run
    Executor._run = run
    try:
        m.decode({0: [1]})
    finally:
        Executor._run = plain


def op_split(m: Model, n: int, runs: int = 3) -> dict:
    """The per-op CPU time of one decode step at context n on one thread (the fastest of `runs`
    per node), by op and by kind; the indexer's share of the step."""
    records: list = []
    for _ in range(runs):
        m.cache.pos[0] = n  # the same step each time: the context does not grow
        _profiled(m, records)
    best = [min(r[i][2] for r in records) for i in range(len(records[0]))]
    ops: dict = {}
    kinds: dict = {k: 0.0 for k in KINDS}
    for (op, ne, _), s in zip(records[0], best):
        ops[op] = ops.get(op, 0.0) + s
        kinds[_kind(op, ne, n + 1, m.cfg.indexer.n_heads, m.top_k)] += s
    total = sum(best)
    indexer = kinds["indexer q.k"] + kinds["indexer sum over heads"]
    return {"total_s": total, "ops_s": dict(sorted(ops.items(), key=lambda kv: -kv[1])), "kinds_s": kinds,
            "indexer_share": indexer / total, "context_share": (total - kinds["rest"]) / total}


# ---- prefill of the DSA layer alone ------------------------------------------------------------

def _layer_graph_time(m: Model, n_past: int, n: int, rng) -> float:
    """CPU seconds (one thread) of the DSA layer's attention block for n tokens after n_past."""
    layer = m.cfg.indexer.layers[0]
    make = partial(GraphBuild, cfg=m.cfg, cache=m.cache, ubatch=UBatch.single(n_past, n), exact=False,
                   top_k=m.top_k, dsa_path=m.dsa_path if m.top_k is not None else "masked")
    nodes = 4096 + mla.attention_nodes(m.cfg, False, UBatch.single(n_past, n).runs[0], m.top_k)
    with m.executor.graph(nodes, make) as g:
        x = g.input("x", F32, (m.cfg.hidden_size, n), rng.standard_normal((n, m.cfg.hidden_size), np.float32))
        out = mla.build_mla(g, m.weights.layer(layer), x)
        t = time.thread_time()
        m.executor.compute(g, [out])  # the inputs' upload is part of a prefill's micro-batch too
        return time.thread_time() - t


def layer_prefill(gguf: Path, base: st.SeqState, prompt: int, n: int, top_k: int) -> dict:
    """Tokens/s of the DSA layer's attention over a `prompt`-token prefill in micro-batches of 512:
    the per-token cost measured at five positions, integrated by the trapezoid."""
    rng = np.random.default_rng(0)
    positions = [n, prompt // 4, prompt // 2, 3 * prompt // 4, prompt]
    out = {}
    for path in ("dense", "masked", "gather"):
        m = load(gguf, path, prompt, 1, top_k, n_ubatch=n)
        try:
            m.state_set(0, long_state(m, base, prompt))
            per_token = [_layer_graph_time(m, pos - n, n, rng) / n for pos in positions]
        finally:
            m.close()
        total = float(np.trapezoid(per_token, positions)) + per_token[0] * positions[0]
        out[path] = {"tok_s": prompt / total, "positions": positions, "s_per_token": per_token}
        print(f"  prefill {prompt} {path}: {prompt / total:.1f} tok/s (layer alone)", file=sys.stderr, flush=True)
    return out


# ---- cache types ----------------------------------------------------------------------------------

def _teacher_forced(gguf: Path, base: st.SeqState, n: int, ids: list[int], top_k: int, threads: int,
                    latent: str, indexer: str):
    """The logits and the DSA layer's selections of `ids` after an n-token context, caches of
    the given types (the context's rows encoded in them, the chunk's written by the graph)."""
    m = Model.load(gguf, n_ctx=n + len(ids), n_threads=threads, repack=False, top_k=top_k, cache_type_k=latent,
                   cache_type_indexer=indexer, n_ubatch=len(ids))
    try:
        m.state_set(0, long_state(m, base, n))
        r = m.run(ids, want=("index_selected",))
        return r.logits.astype(np.float64), r.index_selected[m.cfg.indexer.layers[0]]
    finally:
        m.close()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def _compare(base, other, top_k: int) -> dict:
    (lb, sb), (lo, so) = base, other
    rows = [(a[a >= 0], b[b >= 0]) for a, b in zip(sb, so)]  # the visible selected positions
    same = [np.array_equal(np.sort(a), np.sort(b)) for a, b in rows]
    overlap = [len(np.intersect1d(a, b)) / max(1, len(a)) for a, b in rows]
    pb, po = _log_softmax(lb), _log_softmax(lo)
    kl = (np.exp(pb) * (pb - po)).sum(1)
    return {"selection_identical": float(np.mean(same)), "selection_overlap": float(np.mean(overlap)),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float(np.mean(lb.argmax(1) == lo.argmax(1)))}


def cache_types(gguf: Path, base: st.SeqState, n: int, chunk: int, top_k: int, threads: int) -> dict:
    """Every latent type (indexer F32) and every indexer type (latent F32) against F32 caches:
    `chunk` tokens of text teacher-forced after an n-token context."""
    probe = Model.load(gguf, n_ctx=16, n_threads=threads, repack=False)
    ids = text_tokens(probe, chunk + 97)[97:]  # not the prefill's first tokens
    probe.close()
    f32 = _teacher_forced(gguf, base, n, ids, top_k, threads, "f32", "f32")
    configs = [(t, "f32") for t in LATENT_CACHE_TYPES[1:]] + [("f32", t) for t in INDEXER_CACHE_TYPES[1:]]
    configs.append(("f16", "f16"))  # the default
    out = {}
    for latent, indexer in configs:
        name = f"latent {latent}, indexer {indexer}"
        out[name] = _compare(f32, _teacher_forced(gguf, base, n, ids, top_k, threads, latent, indexer), top_k)
        print(f"  {name}: {out[name]}", file=sys.stderr, flush=True)
    return {"context": n, "tokens": chunk, "top_k": top_k, "types": out}


def cache_bytes_per_1k(gguf: Path) -> dict:
    """Bytes of each cache per 1024 tokens of one sequence, by type: this model and K3.1-Pro."""
    m = Model.load(gguf, n_ctx=16, n_threads=1, repack=False)
    cfg = m.cfg
    m.close()
    out = {}
    for name, t in CACHE_TYPES.items():
        s = cache_sizes(cfg, n_ctx=1024, n_seq=1, latent_type=t, indexer_type=t, with_indexer=True)
        row = {"latent": s.latent if name in LATENT_CACHE_TYPES else None,
               "indexer": s.indexer if name in INDEXER_CACHE_TYPES else None}
        real = {"latent": 24 * 1024 * ggml.ggml_row_size(t, 512 + 64) if name in LATENT_CACHE_TYPES else None,
                "indexer": 24 * 1024 * ggml.ggml_row_size(t, 128) if name in INDEXER_CACHE_TYPES else None}
        out[name] = {"this_model": row, "k31pro": real}
    return out
