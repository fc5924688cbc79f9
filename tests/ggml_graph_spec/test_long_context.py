"""DSA at long range (docs/long-context.md), on a generated model of tiny widths with top_k 64:

* at 4k and 16k contexts the masked and the gathered paths agree: on the exact path the first DSA
  layer selects the same keys on both and the logits are within LOGITS_ATOL (the fp32 bound of
  tests/support/reference.py: the two paths sum the same selected terms in another order), with
  the same greedy tokens; on the fast path the greedy tokens are the same;
* top_k at or above the context is dense MLA bit for bit at 4k;
* at several positions of a 4k context, an independent numpy implementation of the contract's
  indexer (docs/reference/dsa.md#indexer-math) on the cached keys selects what the graph selects;
* a prefill cut into micro-batches of several sizes (-ub), or a micro-batch's attention cut into
  spans, gives the one-shot prefill's logits within LOGITS_ATOL.
"""
from __future__ import annotations

import ggml
import numpy as np
import pytest

from ggml_graph_spec.blocks import mla
from ggml_graph_spec.engine.model import Model

from tests.support import attn_reference as ref
from tests.support.long_context import BASE, TOP_K, gguf_weights, long_state, make_gguf, prefill_state
from tests.support.reference import LOGITS_ATOL, assert_logits

CHUNK = 24  # tokens run after the long context, in one micro-batch
STEPS = 3  # greedy tokens decoded after them


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return make_gguf(tmp_path_factory.mktemp("long-context"))


@pytest.fixture(scope="module")
def base(gguf):
    return prefill_state(gguf)


def _continue(m: Model, state: bytes, chunk: list[int], want=("index_selected",)):
    """Restore `state`, run `chunk` in one micro-batch (its logits and records), then decode STEPS
    greedy tokens; (run result, [STEPS, vocab] decode logits, greedy ids)."""
    m.state_set(0, state)
    r = m.run(chunk, want=want)
    logits, ids = [], []
    nxt = int(r.logits[-1].argmax())
    for _ in range(STEPS):
        ids.append(nxt)
        logits.append(m.decode({0: [nxt]})[0])
        nxt = int(logits[-1].argmax())
    return r, np.stack(logits), ids


def _load(gguf, n: int, path: str, exact: bool, **kw) -> Model:
    return Model.load(gguf, n_ctx=n + CHUNK + STEPS, exact_experts=exact, dsa_path=path, n_threads=1, **kw)


def _paths(gguf, base, n: int, exact: bool) -> dict:
    chunk = np.random.default_rng(n).integers(0, 900, CHUNK).tolist()
    out = {}
    for path in ("masked", "gather"):
        m = _load(gguf, n, path, exact)
        try:
            assert m.top_k == TOP_K
            out[path] = _continue(m, long_state(m, base, n), chunk)
        finally:
            m.close()
    return out


@pytest.mark.parametrize("n", [BASE, 4 * BASE])
def test_masked_and_gathered_agree_at_long_range_on_the_exact_path(gguf, base, n):
    runs = _paths(gguf, base, n, exact=True)
    (rm, dm, im), (rg, dg, ig) = runs["masked"], runs["gather"]
    first, second = sorted(rm.index_selected)
    np.testing.assert_array_equal(rg.index_selected[first], rm.index_selected[first])
    assert (rm.index_selected[first] >= BASE).any()  # the selection reaches past the prefill's copy
    assert_logits(rg.logits, rm.logits, f"chunk at {n}")
    assert_logits(dg, dm, f"decode at {n}")
    assert ig == im


@pytest.mark.parametrize("n", [BASE, 4 * BASE])
def test_masked_and_gathered_give_the_same_greedy_tokens_on_the_fast_path(gguf, base, n):
    """The first DSA layer reads the same bits on both paths and selects the same keys; after it
    the kernels round differently (F16 queries in flash attention, F16 products over the gathered
    rows), which moves the logits by F16 steps: a position of the chunk whose top two logits are
    closer than that may rank them either way (measured: 4e-4 apart at 16k), so the claim is the
    greedy continuation's."""
    runs = _paths(gguf, base, n, exact=False)
    (rm, _, im), (rg, _, ig) = runs["masked"], runs["gather"]
    first = min(rm.index_selected)
    np.testing.assert_array_equal(rg.index_selected[first], rm.index_selected[first])
    assert ig == im


def test_top_k_at_the_context_is_dense_bit_for_bit_at_4k(gguf, base):
    chunk = np.random.default_rng(7).integers(0, 900, CHUNK).tolist()
    dense = Model.load(gguf, n_ctx=BASE + CHUNK + STEPS, exact_experts=True, dsa=False, n_threads=1)
    try:
        want = _continue(dense, long_state(dense, base, BASE), chunk, want=())
    finally:
        dense.close()
    for path in ("masked", "gather"):
        m = _load(gguf, BASE, path, True, top_k=BASE + CHUNK + STEPS)
        try:
            got = _continue(m, long_state(m, base, BASE), chunk, want=())
        finally:
            m.close()
        np.testing.assert_array_equal(got[0].logits, want[0].logits)
        np.testing.assert_array_equal(got[1], want[1])


# ---- an independent selection ---------------------------------------------------------------------

_INDEXER_WEIGHTS = ("attn_q_a.weight", "attn_q_a_norm.weight", "indexer.attn_q_b.weight", "indexer.proj.weight")


def _cached_keys(m: Model, layer: int, n_kv: int) -> np.ndarray:
    t = m.cache.indexer_keys(layer)
    keys = np.empty((n_kv, t.contents.ne[0]), np.float32)
    ggml.ggml_backend_tensor_get(t, keys.ctypes.data, 0, keys.nbytes)
    return keys


def _numpy_scores(cfg, W: dict, x: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Contract section 3 in float64 for queries x [T, n_embd] over cached keys [n_kv, D_I]:
    (scores [T, n_kv], a bound on each score's float32 rounding in the graph [T, n_kv]).

    The bound: every value the graph makes on the way (the q-LoRA latent, the queries, the head
    weights, each q.k, the weighted sum) is a sum of products, whose float32 result is within
    n u sum|terms| of the exact sum for n terms (u = 2^-24, Higham's gamma_n to first order). The
    sums of |terms| along the chain are bounded by the same formula on absolute values (mags);
    n is the longest chain of terms: hidden + q_lora (two projections) + D_I + H_I, times 2 for
    the norms, the scales and the conversion of the weights."""
    ix, u = cfg.indexer, 2.0 ** -24
    W64 = {k: v.astype(np.float64) for k, v in W.items()}
    x = x.astype(np.float64)
    cq = ref.q_lora_latent(W64, x)
    q = (cq @ W64["indexer.attn_q_b.weight"].T).reshape(len(x), ix.n_heads, ix.head_dim)
    w = (x @ W64["indexer.proj.weight"].T) * ix.n_heads ** -0.5 * ix.head_dim ** -0.5
    k = keys.astype(np.float64)
    scores = np.einsum("th,tsh->ts", w, np.maximum(np.einsum("thd,sd->tsh", q, k), 0.0))
    q_mag = (np.abs(cq) @ np.abs(W64["indexer.attn_q_b.weight"]).T).reshape(q.shape)
    w_mag = (np.abs(x) @ np.abs(W64["indexer.proj.weight"]).T) * ix.n_heads ** -0.5 * ix.head_dim ** -0.5
    mag = np.einsum("th,tsh->ts", w_mag, np.einsum("thd,sd->tsh", q_mag, np.abs(k)))
    n = 2 * (cfg.hidden_size + cfg.q_lora_rank + ix.head_dim + ix.n_heads)
    return scores, n * u * mag


def test_an_independent_numpy_selection_equals_the_graphs_at_a_4k_context(gguf, base):
    """Every query of a chunk after 4k tokens, both DSA layers: the graph's selected set is the
    numpy one, but where numpy's k-th score and a differing key's score are within the float32
    bound of each other (a near-tie either implementation may break either way)."""
    m = _load(gguf, BASE, "gather", True)
    try:
        m.state_set(0, long_state(m, base, BASE))
        chunk = np.random.default_rng(3).integers(0, 900, CHUNK).tolist()
        r = m.run(chunk, want=("index_selected", "attn_input"))
        n_kv, checked = BASE + CHUNK, 0
        for layer in m.cfg.indexer.layers:
            keys = _cached_keys(m, layer, n_kv)
            scores, bound = _numpy_scores(m.cfg, gguf_weights(gguf, layer, _INDEXER_WEIGHTS), r.attn_input[layer], keys)
            for t in range(CHUNK):
                visible = BASE + t + 1
                want = ref.select(scores[t:t + 1, :visible], TOP_K, visible - 1)[0]
                got = np.sort(r.index_selected[layer][t][r.index_selected[layer][t] >= 0])
                assert len(got) == TOP_K and got.max() < visible
                v = np.sort(scores[t, want])[0]  # numpy's k-th largest
                for s in np.setxor1d(got, want):
                    assert abs(scores[t, s] - v) <= bound[t, s] + bound[t, want].max(), (layer, t, s)
                checked += int(np.intersect1d(got, want).size)
        assert checked >= 0.99 * len(m.cfg.indexer.layers) * CHUNK * TOP_K
    finally:
        m.close()


# ---- chunked prefill ---------------------------------------------------------------------------

PROMPT = 600


def _prefill(gguf, ids, **kw) -> np.ndarray:
    m = Model.load(gguf, n_ctx=PROMPT, exact_experts=True, n_threads=1, **kw)
    try:
        return m.decode({0: ids}, logits="all")[0]
    finally:
        m.close()


def test_chunked_prefill_equals_the_one_shot_prefill(gguf, monkeypatch):
    """-ub 7, 64 and 256 against one graph of all 600 tokens, and that graph with its attention
    cut into spans of 5 tokens (mla.ATTN_CHUNK_BYTES): the prompt is in the sparse regime from
    token 64 on, so every chunk's selection runs over keys of earlier chunks."""
    ids = np.random.default_rng(5).integers(0, 900, PROMPT)
    one_shot = _prefill(gguf, ids, n_ubatch=PROMPT)
    for n_ubatch in (7, 64, 256):
        assert_logits(_prefill(gguf, ids, n_ubatch=n_ubatch), one_shot, f"-ub {n_ubatch}")
    m = Model.load(gguf, n_ctx=PROMPT, exact_experts=True, n_threads=1)
    try:
        per_token = 4 * max(m.cfg.indexer.n_heads, m.cfg.num_heads) * PROMPT
    finally:
        m.close()
    monkeypatch.setattr(mla, "ATTN_CHUNK_BYTES", 5 * per_token)
    assert_logits(_prefill(gguf, ids, n_ubatch=PROMPT), one_shot, "spans of 5 tokens")
