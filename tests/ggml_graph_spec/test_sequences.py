"""Many sequences in one graph (engine/model.py, graph/ubatch.py): each sequence's logits in a
mixed batch are its own.

What can differ, and why: batching changes which kernel one ggml op takes in exactly one place.
ggml's F32 / BF16 / F16 matmul runs a single column with its dot-product kernel (gemv) and two or
more with llamafile's sgemm, which sums in another order (quantized weights, MXFP4 and Q8_0, give
the same bits at any column count; every other op is per token, per sequence or per (sequence,
head)). So:

* a sequence run with a twin (the same tokens in a second sequence, so that every matmul has at
  least two columns, as in any mixed batch) gives bit for bit the logits it gives in a mixed batch
  of other sequences, other lengths and other positions, on both paths and every DSA setting;
* against a run alone (one column while decoding) the exact path differs by fp32 summation order
  only: both runs are within LOGITS_ATOL of Moonshot's reference (tests/support/reference.py
  derives it from the reference's own float32-vs-float64 noise), so they are within 2 x LOGITS_ATOL
  of each other, with the same greedy tokens; the fast path rounds activations to BF16 / 8 bits
  after each matmul, which turns the summation-order difference into whole rounding steps that the
  random fixture amplifies over depth, as it does the MXFP4 error: both runs are within the fast
  path's bound of the reference (test_model.test_fast_path_stays_within_the_mxfp4_bound), so within
  twice it of each other.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ggml_graph_spec.engine.model import EvalError, Model
from ggml_graph_spec.engine.options import LoadOptions
from ggml_graph_spec.engine.state import FORMAT_VERSION, MAGIC, StateError

from tests.support.paths import REPO
from tests.support.reference import LOGITS_ATOL, assert_logits, load_reference

FAST_BOUND_SHORT = 2.5  # the fast path's bound of the reference on the short prompt (test_model)
N_CTX_SEQ = 128
SETTINGS = [("k3", True, None), ("k31pro", True, "gather"), ("k31pro", True, "masked"), ("k31pro", False, "gather"),
            ("k31pro", False, "masked"), ("k31pro-dense", True, None)]


@pytest.fixture(scope="module")
def ggufs(k3_tiny_gguf, k31pro_tiny_gguf):
    return {"k3": k3_tiny_gguf, "k31pro": k31pro_tiny_gguf, "k31pro-dense": k31pro_tiny_gguf}


def _options(name: str, exact: bool, dsa_path: str | None, n_seq: int, **kw) -> LoadOptions:
    dsa = {"k3": None, "k31pro": True, "k31pro-dense": False}[name]
    top_k = 4 if dsa else None  # below the prompts' lengths: the sparse regime
    return LoadOptions(n_ctx=N_CTX_SEQ * n_seq, n_seq=n_seq, exact_experts=exact, dsa=dsa, dsa_path=dsa_path,
                       top_k=top_k, n_threads=2, **kw)


def _prompts(seed: int = 0) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    return {s: rng.integers(0, 600, n).tolist() for s, n in ((0, 7), (1, 3), (2, 11))}


def _greedy(model: Model, feeds: dict[int, list[int]], steps: int, twins: dict[int, int] | None = None) -> dict:
    """Prefill every sequence of `feeds` in one call, then decode `steps` greedy tokens for all of
    them in one call per step; seq -> [steps + 1, vocab]. twins: seq -> a second sequence fed the
    same tokens."""
    twins = twins or {}
    out: dict[int, list[np.ndarray]] = {s: [] for s in feeds}
    batch = dict(feeds)
    for _ in range(steps + 1):
        logits = model.decode({**batch, **{t: batch[s] for s, t in twins.items()}})
        for s in feeds:
            out[s].append(logits[s])
        batch = {s: [int(np.argmax(out[s][-1]))] for s in feeds}
    return {s: np.stack(v) for s, v in out.items()}


@pytest.mark.parametrize("name,exact,dsa_path", SETTINGS)
def test_a_mixed_batch_gives_each_sequence_its_twin_runs_logits_bit_for_bit(ggufs, name, exact, dsa_path):
    """Three sequences of different lengths, one with a history of its own first (another
    position), prefilled and decoded together, against each run with only its twin."""
    prompts, history = _prompts(), _prompts(1)[2]
    m = Model.load(ggufs[name], _options(name, exact, dsa_path, n_seq=4))
    try:
        m.decode({2: history})
        mixed = _greedy(m, prompts, steps=3)
        for s, prompt in prompts.items():
            m.reset()
            if s == 2:
                m.decode({2: history, 3: history})
            twin = _greedy(m, {s: prompt}, steps=3, twins={s: 3})
            np.testing.assert_array_equal(mixed[s], twin[s], err_msg=f"sequence {s}")
    finally:
        m.close()


def _reference_runs(gguf, ref, exact: bool, top_k: int | None, prefix: str) -> tuple[dict, dict]:
    """(mixed, alone): the long prompt in sequence 0 and the short prompt's greedy continuation in
    sequence 1, decoded together, and each alone; seq -> logits [n, vocab]."""
    steps = len(ref[prefix + "greedy_ids"])
    opts = LoadOptions(n_ctx=2 * N_CTX_SEQ, n_seq=2, exact_experts=exact, top_k=top_k, n_threads=2)
    m = Model.load(gguf, opts)
    try:
        long_ids, short_ids = ref["input_ids_long"], ref["input_ids_short"]
        first = m.decode({0: long_ids, 1: short_ids}, logits="all")
        mixed = {0: first[0], 1: [first[1][-1]]}
        for i in range(steps - 1):
            step = m.decode({0: [int(ref[prefix + "greedy_ids"][i])], 1: [int(np.argmax(mixed[1][-1]))]})
            mixed[1].append(step[1])
        m.reset()
        alone = {0: m.decode({0: long_ids}, logits="all")[0]}
        m.reset()
        alone[1] = [m.decode({1: short_ids})[1]]
        for _ in range(steps - 1):
            alone[1].append(m.decode({1: [int(np.argmax(alone[1][-1]))]})[1])
    finally:
        m.close()
    return mixed, alone


@pytest.mark.parametrize("name", ["k3", "k31pro", "k31pro-top8"])
def test_exact_path_mixed_batch_matches_the_reference_and_the_runs_alone(name, ggufs, k3_tiny_dir, k31pro_tiny_dir):
    ref = load_reference(k3_tiny_dir if name == "k3" else k31pro_tiny_dir)
    prefix, top_k = ("topk8__", 8) if name == "k31pro-top8" else ("", None)
    mixed, alone = _reference_runs(ggufs[name.removesuffix("-top8")], ref, True, top_k, prefix)
    assert_logits(mixed[0], ref[prefix + "logits_long"], "mixed batch, long prompt")
    assert_logits(np.stack(mixed[1]), ref[prefix + "greedy_step_logits"], "mixed batch, greedy steps")
    assert [int(np.argmax(x)) for x in mixed[1]] == ref[prefix + "greedy_ids"].tolist()
    for s in (0, 1):
        got, want = np.atleast_2d(np.stack(mixed[s])), np.atleast_2d(np.stack(alone[s]))
        assert_logits(got, want, f"sequence {s}: mixed vs alone", atol=2 * LOGITS_ATOL)


def test_fast_path_mixed_batch_is_within_twice_the_fast_bound_of_the_runs_alone(ggufs, k31pro_tiny_dir):
    ref = load_reference(k31pro_tiny_dir)
    mixed, alone = _reference_runs(ggufs["k31pro"], ref, False, None, "")
    for s in (0, 1):
        got, want = np.atleast_2d(np.stack(mixed[s])), np.atleast_2d(np.stack(alone[s]))
        assert np.abs(got - want).max() < 2 * FAST_BOUND_SHORT, f"sequence {s}"
    # the prefill of the long prompt runs the same kernels in both (many columns): equal bits
    np.testing.assert_array_equal(mixed[0], alone[0])


# ---- fork, save, restore ---------------------------------------------------------------------

@pytest.mark.parametrize("exact", [True, False])
def test_a_forked_sequence_continues_exactly_as_the_original(k31pro_tiny_gguf, exact):
    prompt = _prompts()[2]
    m = Model.load(k31pro_tiny_gguf, _options("k31pro", exact, "gather", n_seq=3))
    try:
        m.decode({0: prompt})
        m.seq_cp(0, 1)
        assert m.seq_tokens(1) == m.seq_tokens(0) == prompt and m.seq_pos(1) == len(prompt)
        both = _greedy(m, {0: [5], 1: [5]}, steps=4)
        np.testing.assert_array_equal(both[0], both[1])
    finally:
        m.close()


def _continue_alone(model: Model, seq: int, steps: int) -> list[int]:
    tokens = [7]
    for _ in range(steps):
        tokens.append(int(np.argmax(model.decode({seq: [tokens[-1]]})[seq])))
    return tokens


@pytest.mark.parametrize("exact,dsa_path", [(True, "gather"), (False, "masked"), (False, "gather")])
def test_a_saved_state_restored_in_a_new_context_continues_with_the_same_tokens(k31pro_tiny_gguf, tmp_path,
                                                                                   exact, dsa_path):
    prompt = _prompts()[2]
    opts = _options("k31pro", exact, dsa_path, n_seq=2)
    m = Model.load(k31pro_tiny_gguf, opts)
    try:
        m.decode({1: prompt})
        m.state_save(1, tmp_path / "seq.state")
        data = m.state_get(1)
        want = _continue_alone(m, 1, steps=6)
    finally:
        m.close()
    other = Model.load(k31pro_tiny_gguf, opts)
    try:
        assert other.state_set(0, data) == len(prompt)
        assert other.seq_tokens(0) == prompt
        assert _continue_alone(other, 0, steps=6) == want
    finally:
        other.close()
    script = ("import sys, numpy as np\nfrom ggml_graph_spec.engine.model import Model\n"
              "from ggml_graph_spec.engine.options import LoadOptions\n"
              f"m = Model.load(sys.argv[1], LoadOptions(**{_plain(opts)!r}))\n"
              "m.state_load(1, sys.argv[2])\nt = [7]\n"
              "for _ in range(6):\n    t.append(int(np.argmax(m.decode({1: [t[-1]]})[1])))\nprint(t)\n")
    res = subprocess.run([sys.executable, "-c", script, str(k31pro_tiny_gguf), str(tmp_path / "seq.state")],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(want)


def _plain(opts: LoadOptions) -> dict:
    return {k: getattr(opts, k) for k in ("n_ctx", "n_seq", "exact_experts", "dsa", "dsa_path", "top_k", "n_threads")}


def test_seq_rm_forgets_one_sequence_and_leaves_the_others(k31pro_tiny_gguf):
    m = Model.load(k31pro_tiny_gguf, _options("k31pro", True, "gather", n_seq=2))
    try:
        m.decode({0: _prompts()[0], 1: _prompts()[1]})
        keep = m.state_get(1)
        m.seq_rm(0)
        assert m.seq_pos(0) == 0 and m.seq_tokens(0) == [] and m.state_get(1) == keep
        fresh = m.decode({0: [1, 2, 3]})[0]
        m.reset()
        np.testing.assert_array_equal(m.decode({0: [1, 2, 3]})[0], fresh)
    finally:
        m.close()


# ---- bad input: one clear error, nothing changed ---------------------------------------------

@pytest.fixture
def two_seqs(k31pro_tiny_gguf):
    m = Model.load(k31pro_tiny_gguf, _options("k31pro", True, "gather", n_seq=2))
    m.decode({0: [1, 2, 3]})
    yield m
    m.close()


def _unchanged(m: Model, before: bytes) -> None:
    assert m.state_get(0) == before and m.seq_pos(1) == 0


@pytest.mark.parametrize("batch,message", [
    ({2: [1]}, r"sequence id 2 is out of range: this context has sequences 0\.\.1"),
    ({-1: [1]}, "sequence id -1 is out of range"),
    ({0: [1], 1: list(range(200))}, r"context full: 0 cached \+ 200 new tokens > n_ctx 128 \(sequence 1\)"),
    ({0: [5], 1: [10 ** 6]}, "token id 1000000 is outside the vocabulary"),
    ({1: []}, "no tokens to evaluate for sequence 1"),
])
def test_a_bad_batch_is_refused_whole(two_seqs, batch, message):
    before = two_seqs.state_get(0)
    with pytest.raises(EvalError, match=message):
        two_seqs.decode(batch)
    _unchanged(two_seqs, before)


def test_a_sequence_twice_in_one_batch_is_refused(two_seqs):
    before = two_seqs.state_get(0)
    with pytest.raises(EvalError, match="a sequence appears twice in one batch"):
        two_seqs.decode([(1, [1]), (1, [2])])
    _unchanged(two_seqs, before)


def _retyped(data: bytes, **changes) -> bytes:
    """A copy of a state with a header field changed and a valid checksum (what a file from other
    settings would hold)."""
    import hashlib
    import json
    import struct
    n = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[16:16 + n])
    header.update(changes)
    new = json.dumps(header).encode()
    body = data[:12] + struct.pack("<I", len(new)) + new + data[16 + n:-32]
    return body + hashlib.sha256(body).digest()


def test_a_state_of_another_model_version_or_settings_is_refused(two_seqs, k3_tiny_gguf, tmp_path):
    good = two_seqs.state_get(0)
    other = Model.load(k3_tiny_gguf, n_ctx=N_CTX_SEQ, exact_experts=True, n_threads=2)
    try:
        other.decode({0: [1, 2, 3]})
        foreign = other.state_get(0)
    finally:
        other.close()
    cases = [
        (foreign, "saved from another model"),
        (good[:-40], "truncated or damaged"),
        (good[:10], "truncated"),
        (b"GGUF" + good[4:], "not a kimi-k3 sequence state"),
        (good[:8] + (FORMAT_VERSION + 1).to_bytes(4, "little") + good[12:],
         f"format version {FORMAT_VERSION + 1}; this build reads version {FORMAT_VERSION}"),
        (good[:-1] + bytes([good[-1] ^ 1]), "damaged \\(its SHA-256 checksum does not match\\)"),
        (_retyped(good, cache_types={"latent": "f16", "indexer": "f32"}), "saved with cache types indexer f32, latent f16; this context has indexer f32, latent f32"),
        (_retyped(good, cache_types={"latent": "f32", "indexer": None}), "saved with cache types indexer none"),
    ]
    assert good.startswith(MAGIC)
    before = two_seqs.state_get(1)
    for data, message in cases:
        with pytest.raises(StateError, match=message):
            two_seqs.state_set(1, data)
        assert two_seqs.state_get(1) == before
    with pytest.raises(StateError, match="cannot read the sequence state"):
        two_seqs.state_load(1, tmp_path / "missing.state")


def test_a_state_longer_than_the_context_is_refused(k31pro_tiny_gguf):
    big = Model.load(k31pro_tiny_gguf, _options("k31pro", True, "gather", n_seq=1))
    small = Model.load(k31pro_tiny_gguf, LoadOptions(n_ctx=16, exact_experts=True, dsa=True, top_k=4, n_threads=2))
    try:
        big.decode({0: list(range(40))})
        with pytest.raises(StateError, match="holds 40 tokens; a sequence of this context holds at most 16"):
            small.state_set(0, big.state_get(0))
        assert small.seq_pos(0) == 0
    finally:
        big.close()
        small.close()


def test_load_options_for_sequences_are_checked(k31pro_tiny_gguf):
    with pytest.raises(Exception, match=r"-np/--parallel \(n_seq\) must be an integer >= 1"):
        Model.load(k31pro_tiny_gguf, n_ctx=64, n_seq=0)
    with pytest.raises(Exception, match=r"-c 3 over -np 4 sequences gives each 0 tokens"):
        Model.load(k31pro_tiny_gguf, n_ctx=3, n_seq=4)


# ---- the other backends ------------------------------------------------------------------------

def _mixed_run(gguf, **kw) -> dict:
    m = Model.load(gguf, _options("k31pro", False, "gather", n_seq=3, **kw))
    try:
        m.decode({2: _prompts(1)[2]})
        return _greedy(m, _prompts(), steps=3)
    finally:
        m.close()


def test_a_mixed_batch_under_a_memory_budget_equals_the_unlimited_one(k31pro_tiny_gguf):
    """The streaming executor reads the experts the whole batch selects (the union) once a step
    and computes from the same bytes: the same logits bit for bit at half the file. The baseline is
    the mapped run without repack: a memory budget never repacks (it reads the experts from the
    file), and the default load's repacked experts take other kernels, whose sums round otherwise
    (test_repack.py bounds that difference)."""
    unlimited = _mixed_run(k31pro_tiny_gguf, repack=False)
    budget = _mixed_run(k31pro_tiny_gguf, mem_budget=k31pro_tiny_gguf.stat().st_size // 2)
    for s in unlimited:
        np.testing.assert_array_equal(budget[s], unlimited[s], err_msg=f"sequence {s}")


def test_a_mixed_batch_over_rpc_equals_the_local_one(k31pro_tiny_gguf):
    """Each sequence's caches live on its layers' devices (a plane per sequence there too), and
    the servers compute from the same bytes as the local mapped weights: the same logits bit for
    bit. The baseline is the local run without repack: --rpc never repacks, and the default load's
    repacked experts take other kernels, whose sums round otherwise (test_repack.py bounds that)."""
    from tests.support.rpc_servers import RpcServers
    local = _mixed_run(k31pro_tiny_gguf, repack=False)
    with RpcServers(2) as servers:
        remote = _mixed_run(k31pro_tiny_gguf, rpc=servers.endpoints, tensor_split="1,1,1")
    for s in local:
        np.testing.assert_array_equal(remote[s], local[s], err_msg=f"sequence {s}")


# ---- what the caches take ---------------------------------------------------------------------

@pytest.mark.parametrize("exact,n_seq", [(False, 1), (False, 3), (True, 2)])
def test_cache_bytes_per_token_and_sequence_are_the_formula(k31pro_tiny_gguf, exact, n_seq):
    """Each cache's bytes, as the summary prints them, are the model's sizes times the context:
    F32 caches on the exact path, llama.cpp's F16 for both on the fast one."""
    from ggml_graph_spec.runner.summary import summary
    m = Model.load(k31pro_tiny_gguf, _options("k31pro", exact, "gather", n_seq=n_seq))
    try:
        cfg, kda = m.cfg, m.cfg.kda
        size = 4 if exact else 2
        latent = len(cfg.mla_layers) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size
        indexer = len(cfg.indexer.layers) * cfg.indexer.head_dim * size
        conv = len(kda.layers) * 4 * 3 * (kda.conv_kernel - 1) * kda.proj_dim
        recurrent = len(kda.layers) * 4 * kda.head_dim ** 2 * kda.num_heads
        assert m.cache.bytes_per_token() == {"latent": latent, "indexer": indexer}
        assert m.cache.bytes_per_sequence() == conv + recurrent
        want = n_seq * (conv + recurrent + N_CTX_SEQ * (latent + indexer))
        n_tensors = 4 * len(kda.layers) + 2 * len(cfg.mla_layers)
        assert want <= m.cache.nbytes(m.executor.backend) <= want + 64 * n_tensors  # each tensor aligned
        lines = {x[len("print_info: "):].split("=")[0].strip(): x.split("= ", 1)[1] for x in summary(m)}
        kind = "f32" if exact else "f16"
        assert lines["cache latent"].startswith(f"{kind}: {len(cfg.mla_layers)} MLA layer(s) x {n_seq} seq x "
                                                f"{N_CTX_SEQ} tokens x {latent // len(cfg.mla_layers)} B = "
                                                f"{n_seq * N_CTX_SEQ * latent} bytes")
        assert lines["cache indexer"].startswith(f"{kind}: {len(cfg.indexer.layers)} DSA layer(s) x {n_seq} seq x "
                                                 f"{N_CTX_SEQ} tokens x {indexer // len(cfg.indexer.layers)} B = "
                                                 f"{n_seq * N_CTX_SEQ * indexer} bytes")
        assert lines["cache KDA"].startswith(f"f32: {len(kda.layers)} KDA layer(s) x {n_seq} seq, conv "
                                             f"{n_seq * conv} bytes")
        assert f"recurrent {n_seq * recurrent} bytes" in lines["cache KDA"]
        assert lines["caches"].startswith(f"{want} bytes")
    finally:
        m.close()


def test_a_batch_over_n_batch_goes_through_in_micro_batches_with_the_reference_logits(k31pro_tiny_gguf,
                                                                                      k31pro_tiny_dir):
    """96 + 12 prompt tokens, 16 a graph: the long prompt is cut over seven micro-batches, the
    first of which also holds the short one; each sequence's logits are the reference's."""
    ref = load_reference(k31pro_tiny_dir)
    m = Model.load(k31pro_tiny_gguf, LoadOptions(n_ctx=2 * N_CTX_SEQ, n_seq=2, exact_experts=True, n_batch=16,
                                                 n_threads=2))
    try:
        out = m.decode({1: ref["input_ids_short"], 0: ref["input_ids_long"]}, logits="all")
        assert_logits(out[0], ref["logits_long"], "long prompt in micro-batches")
        assert_logits(out[1], ref["logits_short"], "short prompt beside it")
        assert m.seq_pos(0) == 96 and m.seq_pos(1) == 12
    finally:
        m.close()


# ---- embedding rows in place of tokens (images) ----------------------------------------------

def _token_rows(gguf, ids) -> np.ndarray:
    """The token embedding rows of ids as F32 (what get_rows makes of the GGUF's table)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    t = next(t for t in GGUFReader(gguf).tensors if t.name == "token_embd.weight")
    return dequantize(t.data, t.tensor_type).reshape(-1, t.shape[0])[ids].astype(np.float32)


@pytest.mark.parametrize("exact", [True, False])
def test_embedding_rows_in_a_mixed_batch_are_the_tokens_they_embed(k31pro_tiny_gguf, exact):
    """Sequence 1 is fed as embedding rows (the token table's own rows of its prompt), beside
    sequence 0's tokens: the logits are those of the tokens, bit for bit, and the history records
    each row as EMBEDDING_POS."""
    from ggml_graph_spec.engine.inputs import EMBEDDING_POS
    prompts = _prompts()
    rows = _token_rows(k31pro_tiny_gguf, prompts[1])
    m = Model.load(k31pro_tiny_gguf, _options("k31pro", exact, "gather", n_seq=3))
    try:
        as_rows = m.decode({0: prompts[0], 1: rows, 2: prompts[1]}, logits="all")
        np.testing.assert_array_equal(as_rows[1], as_rows[2])
        assert m.seq_tokens(1) == [EMBEDDING_POS] * len(rows) and m.seq_tokens(2) == prompts[1]
        with pytest.raises(EvalError, match=r"embedding rows for sequence 1 must be \[n >= 1, 64\]"):
            m.decode({1: rows[:, :8]})
        with pytest.raises(EvalError, match="non-finite"):
            m.decode({1: np.full_like(rows, np.nan)})
    finally:
        m.close()
