"""Cache types (-ctk for the MLA latent, --cache-type-indexer for the DSA indexer keys), what a
context needs in memory and how a long micro-batch is bounded (docs/long-context.md):

* every type loads, decodes, saves and restores a sequence's state (in the same and a new model),
  and gives a twin sequence its bits; the summary prints each cache's bytes, the formula's;
* an unknown type, a type the path cannot use, a latent row that is not whole Q8_0 blocks: one
  OptionError line (exit 2 in the CLI);
* a context that does not fit is refused at load with the bytes it needs and what is free; one
  that fits reserves its compute buffer there, which no later call grows;
* no tensor of a micro-batch's graph that grows with the context holds more than the span bound
  (mla.ATTN_CHUNK_BYTES), the causal mask input aside.
"""
from __future__ import annotations

import ggml
import numpy as np
import pytest

from gguf_arch.io.console import human_size
from ggml_graph_spec.blocks import mla
from ggml_graph_spec.blocks.forward import build_forward
from ggml_graph_spec.engine import memory
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.engine.options import OptionError
from ggml_graph_spec.engine.state import StateError
from ggml_graph_spec.graph.build import I32
from ggml_graph_spec.graph.cache import cache_sizes
from ggml_graph_spec.graph.ubatch import UBatch
from ggml_graph_spec.runner.summary import summary

from tests.ggml_graph_spec.test_sequences import _greedy, _prompts
from tests.support.cli import run_runner
from tests.support.long_context import make_gguf

N_CTX = 256
# Bytes of a row of n values: 2 for F16 / BF16, 4 for F32, Q8_0 blocks of 32 values in 34 bytes.
ROW_BYTES = {"f32": lambda n: 4 * n, "f16": lambda n: 2 * n, "bf16": lambda n: 2 * n, "q8_0": lambda n: n // 32 * 34}
CONFIGS = [("f32", "f16"), ("f16", "f16"), ("bf16", "f16"), ("q8_0", "f16"), ("f16", "f32"), ("f16", "bf16")]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return make_gguf(tmp_path_factory.mktemp("cache-types"))


def _load(gguf, latent: str, indexer: str, **kw) -> Model:
    return Model.load(gguf, n_ctx=kw.pop("n_ctx", N_CTX), cache_type_k=latent, cache_type_indexer=indexer,
                      top_k=kw.pop("top_k", 16), n_threads=1, **kw)


@pytest.mark.parametrize("latent,indexer", CONFIGS)
def test_each_cache_type_decodes_and_restores_its_state(gguf, tmp_path, latent, indexer):
    prompt = np.random.default_rng(0).integers(0, 900, 100).tolist()
    m = _load(gguf, latent, indexer)
    try:
        assert (m.cache.latent_type_name, m.cache.indexer_type_name) == (latent, indexer)
        logits = m.decode({0: prompt})[0]
        nxt = int(logits.argmax())
        saved = m.state_save(0, tmp_path / "seq.state")
        cfg = m.cfg
        rows = ROW_BYTES[latent](cfg.kv_lora_rank + cfg.qk_rope_head_dim) * len(cfg.mla_layers) + \
            ROW_BYTES[indexer](cfg.indexer.head_dim) * len(cfg.indexer.layers)
        assert saved > len(prompt) * rows  # the rows of the sequence's tokens, of the cache's types, are in it
        alone = m.decode({0: [nxt]})[0]
        assert np.isfinite(alone).all()
    finally:
        m.close()
    again = _load(gguf, latent, indexer)
    try:
        assert again.state_load(0, tmp_path / "seq.state") == len(prompt)
        np.testing.assert_array_equal(again.decode({0: [nxt]})[0], alone)
    finally:
        again.close()
    other = _load(gguf, "f32" if latent != "f32" else "f16", indexer)
    try:
        with pytest.raises(StateError, match="saved with cache types"):
            other.state_load(0, tmp_path / "seq.state")
    finally:
        other.close()


@pytest.mark.parametrize("latent,indexer,dsa_path", [("q8_0", "bf16", "gather"), ("q8_0", "f32", "masked"),
                                                     ("bf16", "bf16", "masked")])
def test_a_twin_gets_the_same_bits_with_every_cache_type(gguf, latent, indexer, dsa_path, monkeypatch):
    """As test_sequences' mixed batch, with other cache types and the attention in spans of a few
    tokens: each sequence's logits in a mixed batch are its twin run's, bit for bit."""
    monkeypatch.setattr(mla, "ATTN_CHUNK_BYTES", 3 * 4 * 4 * 16)  # 3 tokens a span at 16 keys, fewer later
    m = _load(gguf, latent, indexer, n_ctx=4 * 64, n_seq=4, dsa_path=dsa_path, top_k=4)
    try:
        prompts = _prompts()
        mixed = _greedy(m, prompts, steps=2)
        for s, prompt in prompts.items():
            m.reset()
            np.testing.assert_array_equal(mixed[s], _greedy(m, {s: prompt}, steps=2, twins={s: 3})[s])
    finally:
        m.close()


@pytest.mark.parametrize("latent,indexer", CONFIGS)
def test_the_summary_prints_each_caches_bytes(gguf, latent, indexer):
    m = _load(gguf, latent, indexer, n_seq=2, n_ctx=2 * N_CTX)
    try:
        cfg = m.cfg
        lines = {x[len("print_info: "):].split("=")[0].strip(): x.split("= ", 1)[1] for x in summary(m)}
        row = ROW_BYTES[latent](cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        assert lines["cache latent"].startswith(f"{latent}: 2 MLA layer(s) x 2 seq x {N_CTX} tokens x {row} B = "
                                                f"{2 * 2 * N_CTX * row} bytes")
        row = ROW_BYTES[indexer](cfg.indexer.head_dim)
        assert lines["cache indexer"].startswith(f"{indexer}: 2 DSA layer(s) x 2 seq x {N_CTX} tokens x {row} B = "
                                                 f"{2 * 2 * N_CTX * row} bytes")
        assert m.cache.sizes() == cache_sizes(cfg, n_ctx=N_CTX, n_seq=2, latent_type=m.cache.latent_type,
                                              indexer_type=m.cache.indexer_type, with_indexer=True)
    finally:
        m.close()


@pytest.mark.parametrize("fields, message", [
    (dict(cache_type_k="q4_0"), "--cache-type-k 'q4_0': expected one of f32, f16, bf16, q8_0"),
    (dict(cache_type_indexer="q8_0"), "--cache-type-indexer 'q8_0': expected one of f32, f16, bf16"),
    (dict(cache_type_k="q8_0", exact_experts=True), "q8_0 is read by flash attention, which the exact path"),
    (dict(cache_type_indexer="bf16", exact_experts=True), "the exact path (--exact-experts) keeps f32 caches"),
    (dict(cache_type_k="q8_0"), "stores blocks of 32 values; this model's latent rows (40 values, of which 32"),
    (dict(n_ubatch=0), "-ub/--ubatch-size (n_ubatch) must be an integer >= 1"),
    (dict(n_batch=-1), "-b/--batch-size (n_batch) must be an integer >= 1"),
])
def test_a_bad_cache_type_or_batch_is_one_line(k31pro_tiny_gguf, fields, message):
    with pytest.raises(OptionError) as e:
        Model.load(k31pro_tiny_gguf, n_ctx=64, **fields)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_cli_flags_make_the_load_options():
    from ggml_graph_spec.runner.args import load_options
    from ggml_graph_spec.runner.cli import build_parser
    a = build_parser().parse_args(["-m", "m.gguf", "-b", "256", "-ub", "64", "-ctk", "q8_0", "--cache-type-indexer", "bf16"])
    o = load_options(a)
    assert (o.n_batch, o.n_ubatch, o.n_ubatch_eff, o.cache_type_k, o.cache_type_indexer) == (256, 64, 64, "q8_0", "bf16")
    o = load_options(build_parser().parse_args(["-m", "m.gguf", "-b", "32"]))
    assert (o.n_batch, o.n_ubatch, o.n_ubatch_eff) == (32, 512, 32)  # llama.cpp: -ub at most -b
    assert o.cache_types() == {"latent": "f16", "indexer": "f16"}
    assert load_options(build_parser().parse_args(["-m", "m.gguf", "--exact-experts"])).cache_types() == \
        {"latent": "f32", "indexer": "f32"}


def test_the_cli_refuses_a_bad_type_and_a_context_beyond_memory_with_exit_2(k31pro_tiny_gguf):
    r = run_runner("-m", k31pro_tiny_gguf, "-p", "x", "-n", "1", "-ctk", "q4_0")
    assert r.returncode == 2 and r.stderr == "error: --cache-type-k 'q4_0': expected one of f32, f16, bf16, q8_0\n"
    n = 1 << 31  # 2^31 tokens of 448 bytes of rows: about a terabyte of caches, refused before any is allocated
    r = run_runner("-m", k31pro_tiny_gguf, "-p", "x", "-n", "1", "-c", n,
                   "--override-kv", f"kimi-k3.context_length=int:{n}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: -c {n} does not fit in memory: the caches need ") and r.stderr.count("\n") == 1
    assert "is free (MemAvailable)" in r.stderr


def _sizes(m_or_cfg, n_ctx: int):
    cfg = m_or_cfg.cfg
    return cache_sizes(cfg, n_ctx=n_ctx, n_seq=1, latent_type=ggml.GGML_TYPE_F16, indexer_type=ggml.GGML_TYPE_F16,
                       with_indexer=True)


def test_a_context_that_does_not_fit_is_refused_at_load(gguf, monkeypatch):
    probe = Model.load(gguf, n_ctx=8192, n_threads=1)
    sizes = _sizes(probe, 8192)
    probe.close()
    monkeypatch.setattr(memory, "free_bytes", lambda: sizes.total - 1)
    with pytest.raises(OptionError) as e:
        Model.load(gguf, n_ctx=8192, n_threads=1)
    assert str(e.value).startswith(f"-c 8192 does not fit in memory: the caches need {human_size(sizes.total)} "
                                   f"(latent {human_size(sizes.latent)}, indexer keys {human_size(sizes.indexer)}, "
                                   f"KDA states {human_size(sizes.kda_conv + sizes.kda_state)}); "
                                   f"{human_size(sizes.total - 1)} is free")
    monkeypatch.setattr(memory, "free_bytes", lambda: sizes.total + 1)  # the caches fit, their compute buffer not
    with pytest.raises(OptionError, match=r"and the compute buffer .* \(micro-batches of 512 tokens at the full "
                                          r"context\), .* in all; .* is free"):
        Model.load(gguf, n_ctx=8192, n_threads=1)


@pytest.mark.parametrize("exact,n_seq", [(False, 1), (True, 2)])
def test_the_compute_buffer_is_reserved_at_load_and_never_grows(gguf, exact, n_seq):
    n = 640  # two micro-batches of 512 and 128, then decode to the last row of the context
    m = Model.load(gguf, n_ctx=n * n_seq, n_seq=n_seq, exact_experts=exact, n_threads=1)
    try:
        reserved = ggml.ggml_gallocr_get_buffer_size(m.executor._galloc, 0)
        assert reserved > 0
        ids = np.random.default_rng(1).integers(0, 900, n - 4)
        m.decode({s: ids for s in range(n_seq)})
        for _ in range(4):
            m.decode({s: [7] for s in range(n_seq)})
        assert m.seq_pos(0) == n
        assert ggml.ggml_gallocr_get_buffer_size(m.executor._galloc, 0) == reserved
    finally:
        m.close()


def _context_tensors(m: Model, n_past: int, n_tokens: int) -> list[tuple[str, int]]:
    """(op, bytes) of every tensor a micro-batch's graph allocates with a dimension of at least
    n_past (views, of the caches or of the mask input, allocate nothing)."""
    out = []
    with m._graph(UBatch([(0, n_past, n_tokens)])) as g:
        logits = build_forward(g, m.weights, g.input("tokens", I32, (n_tokens,), np.zeros(n_tokens, np.int32)))
        ggml.ggml_build_forward_expand(g.gf, logits)
        for i in range(ggml.ggml_graph_n_nodes(g.gf)):
            t = ggml.ggml_graph_node(g.gf, i)
            if not t.contents.view_src and max(t.contents.ne[:4]) >= n_past:
                out.append((ggml.ggml_op_desc(t).decode(), ggml.ggml_nbytes(t)))
    return out


def test_no_tensor_that_grows_with_the_context_exceeds_the_span_bound(gguf, monkeypatch):
    """A micro-batch of 512 tokens at a 16k context, with a 1 MiB span bound: every tensor with a
    dimension of the context's size holds at most 1 MiB; with the spans off (a bound larger than
    the whole micro-batch's q.k), the indexer's [H_I x 512, n_kv] product alone holds 32 MiB."""
    bound, n_ctx, T = 1 << 20, 16384, 512
    m = Model.load(gguf, n_ctx=n_ctx, n_threads=1)
    try:
        monkeypatch.setattr(mla, "ATTN_CHUNK_BYTES", bound)
        tensors = _context_tensors(m, n_ctx - T, T)
        assert tensors and max(b for _, b in tensors) <= bound, sorted(tensors, key=lambda x: -x[1])[:3]
        monkeypatch.setattr(mla, "ATTN_CHUNK_BYTES", 1 << 40)
        assert max(b for _, b in _context_tensors(m, n_ctx - T, T)) >= 4 * T * n_ctx * 4
    finally:
        m.close()
