"""perplexity.py: llama-perplexity's chunked method on synthetic evaluators."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gguf_arch.errors import KimiError
from ggml_graph_spec.generation.perplexity import chunk_count, perplexity, token_nll

VOCAB = 7


def _table_model(seed: int = 0):
    """A bigram 'model': logits of position i depend only on token i; records what it saw."""
    table = np.random.default_rng(seed).normal(size=(VOCAB, VOCAB)).astype(np.float32)
    seen: list[list[int]] = []

    def evaluate(chunk: list[int]) -> np.ndarray:
        seen.append(list(chunk))
        return table[np.asarray(chunk)]

    return table, evaluate, seen


def test_uniform_logits_give_the_vocab_size_and_no_error():
    tokens = list(np.random.default_rng(1).integers(0, VOCAB, size=40))
    r = perplexity(tokens, 8, lambda c: np.zeros((len(c), VOCAB), np.float32), bos=None)
    assert r.ppl == pytest.approx(VOCAB, rel=1e-12)
    assert r.error < 1e-6  # zero variance, up to the rounding of E[x^2] - E[x]^2


def test_matches_a_direct_computation_of_the_second_halves():
    table, evaluate, seen = _table_model()
    tokens = list(np.random.default_rng(2).integers(0, VOCAB, size=53))
    bos = 5
    r = perplexity(tokens, 10, evaluate, bos=bos)

    nll = []
    for c in range(5):  # 53 // 10 chunks
        chunk = tokens[c * 10:(c + 1) * 10]
        for i in range(5, 9):  # positions first .. n_ctx-2 predict first+1 .. n_ctx-1
            prev = bos if i == 0 else chunk[i]
            logp = table[prev] - np.log(np.exp(table[prev].astype(np.float64)).sum())
            nll.append(-logp[chunk[i + 1]])
    nll = np.asarray(nll)
    ppl = math.exp(nll.mean())
    assert r.n_chunks == 5 and r.n_scored == 20
    assert r.ppl == pytest.approx(ppl, rel=1e-12)
    se = math.sqrt((np.mean(nll ** 2) - nll.mean() ** 2) / (len(nll) - 1))
    assert r.error == pytest.approx(se * ppl, rel=1e-9)
    assert r.running[-1] == pytest.approx(r.ppl, rel=1e-12)
    assert all(s[0] == bos for s in seen)  # every chunk starts from BOS
    assert [s[1:] for s in seen] == [tokens[c * 10 + 1:(c + 1) * 10] for c in range(5)]


def test_chunks_flag_limits_the_chunks():
    _, evaluate, seen = _table_model()
    r = perplexity(list(range(VOCAB)) * 10, 8, evaluate, bos=None, n_chunks=3)
    assert r.n_chunks == 3 and len(seen) == 3 and len(r.running) == 3


def test_too_short_text_is_bad_input():
    with pytest.raises(KimiError, match="tokenizes to 15 tokens; need at least 16"):
        chunk_count(15, 8, -1)
    assert chunk_count(16, 8, -1) == 2
    assert chunk_count(100, 8, 4) == 4


def test_token_nll_is_minus_log_softmax():
    logits = np.array([[0.0, math.log(3.0)]], np.float32)
    assert token_nll(logits, np.array([1]))[0] == pytest.approx(-math.log(0.75), rel=1e-6)


# ---- on the K3.1-Pro fixture, through the graph ----------------------------------------------

CHUNK = 32


def _fixture_ppl(gguf, tokens: list[int], **model_kw) -> float:
    from ggml_graph_spec.engine.model import Model

    m = Model.load(gguf, n_ctx=CHUNK, n_threads=2, **model_kw)
    try:
        def evaluate(chunk: list[int]) -> np.ndarray:
            m.reset()
            return m.eval(chunk)

        return perplexity(tokens, CHUNK, evaluate, bos=None, n_chunks=2).ppl
    finally:
        m.close()


@pytest.fixture(scope="module")
def long_prompt(k31pro_tiny_dir) -> list[int]:
    return np.load(k31pro_tiny_dir / "reference.npz")["input_ids_long"].tolist()


def test_dsa_with_top_k_covering_the_chunk_is_dense_attention(k31pro_tiny_gguf, long_prompt):
    # Every query sees at most CHUNK keys, so top_k = CHUNK keeps them all: the selection mask is
    # all zeros on the visible keys and the PPL must be the dense one, bit for bit.
    dense = _fixture_ppl(k31pro_tiny_gguf, long_prompt, dsa=False)
    assert _fixture_ppl(k31pro_tiny_gguf, long_prompt, dsa=True, top_k=CHUNK) == dense
    assert _fixture_ppl(k31pro_tiny_gguf, long_prompt, dsa=True) == dense  # GGUF top_k 2048


def test_dsa_with_a_small_top_k_changes_the_perplexity(k31pro_tiny_gguf, long_prompt):
    dense = _fixture_ppl(k31pro_tiny_gguf, long_prompt, dsa=False)
    sparse = _fixture_ppl(k31pro_tiny_gguf, long_prompt, dsa=True, top_k=4)
    assert abs(sparse - dense) > 1e-3 * dense
