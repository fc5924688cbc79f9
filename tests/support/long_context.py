"""A small K3.1-Pro model at long contexts for the long-context tests: generated with tiny widths
(8 layers: two MLA+DSA layers, 3 and 7, so that the second one's input carries the first one's
attention; a latent row of 64 + 32 values, whole Q8_0 blocks; top_k 64), a real prefill of
BASE tokens once, and states of any longer context made from it by writing cache rows directly.

A longer context repeats the prefill's latent and indexer key rows with a little noise on every
copy after the first (so that no two keys tie and a selection reaches over the whole context,
as a real long text's does); the KDA states are the prefill's. The tokens decoded after it are
real: the model computes them from these rows.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from ggml_graph_spec.engine import state as st
from ggml_graph_spec.engine.model import Model

from tests.support.generated import generated_gguf

SYNTH = ("--layers", "8", "--kv-lora", "64", "--qk-rope", "32", "--index-topk", "64")
TOP_K = 64
BASE = 4096  # tokens of the real prefill
NOISE = 0.05  # of each row's own scale, on every repeated copy
_NUMPY = {"f32": np.float32, "f16": np.float16}


def make_gguf(out_dir: Path) -> Path:
    return generated_gguf(out_dir, "k31pro", *SYNTH)


def prefill_state(gguf: Path, n: int = BASE, seed: int = 0) -> st.SeqState:
    """The exact path's state after n random tokens (one thread: a shared machine's second core
    only stalls a small graph's per-node barriers)."""
    m = Model.load(gguf, n_ctx=n, exact_experts=True, dsa_path="masked", n_threads=1)
    try:
        m.decode({0: np.random.default_rng(seed).integers(0, m.cfg.vocab_size, n)})
        return st.decode(m.state_get(0), "prefill")
    finally:
        m.close()


def _rows(data: bytes, kind: str, n: int) -> np.ndarray:
    return np.frombuffer(data, np.float32).reshape(n, -1)


def long_state(model: Model, base: st.SeqState, n: int, seed: int = 1) -> bytes:
    """A state of n tokens for `model` (its cache types; F32 or F16) from an exact-path state:
    the base rows, then noisy copies of them, cast to the model's types."""
    rng = np.random.default_rng(seed)
    types = model.options.cache_types()
    parts = []
    for kind, data in base.parts:
        if kind not in ("latent", "indexer"):
            parts.append((kind, data))
            continue
        if kind == "indexer" and not model.cache.with_indexer:
            continue
        rows = _rows(data, kind, len(base.tokens))
        reps = -(-n // len(rows))
        tiled = np.concatenate([rows if c == 0 else rows + NOISE * rows.std(1, keepdims=True) *
                                rng.standard_normal(rows.shape, np.float32) for c in range(reps)])[:n]
        parts.append((kind, np.ascontiguousarray(tiled.astype(_NUMPY[types[kind]])).tobytes()))
    tokens = (base.tokens * (-(-n // len(base.tokens))))[:n]
    cache_types = {"latent": types["latent"], "indexer": types["indexer"] if model.cache.with_indexer else None}
    return st.encode(st.SeqState(model.identity, cache_types, tokens, parts))


def gguf_weights(gguf: Path, layer: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Layer tensors as F32 numpy arrays in GGUF layout, keyed by the name after `blk.{layer}.`."""
    prefix = f"blk.{layer}."
    out = {}
    for t in GGUFReader(gguf).tensors:
        if t.name.startswith(prefix) and t.name[len(prefix):] in names:
            shape = tuple(int(x) for x in reversed(t.shape))
            out[t.name[len(prefix):]] = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
    return out
