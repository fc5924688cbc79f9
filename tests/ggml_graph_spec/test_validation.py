"""The runner's options and --override-kv values are checked against what they become before
any ggml object exists (ggml_graph_spec/runner/validation.py): each case runs kimi-k3-cli in a child
process whose ggml_init and weight-buffer calls exit 99, so a value that reached ggml unchecked
fails the test instead of aborting it, and expects exit 2 with one `error:` line."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz.harness import FUZZ
from tests.support.cli import NO_GGML, run_tool

BAD_OVERRIDES = {
    "kimi-k3.attention.indexer.top_k=int:0": "must be >= 1",  # was ZeroDivisionError
    "kimi-k3.attn_res.block_size=int:0": "must be >= 1",  # was ZeroDivisionError
    "kimi-k3.attention.indexer.top_k=int:-5": "0..4294967295",  # was GGML_ASSERT (SIGABRT)
    "kimi-k3.attention.indexer.top_k=int:99999999999": "0..4294967295",
    "kimi-k3.expert_weights_scale=float:inf": "finite",  # was "Probabilities contain NaN"
    "kimi-k3.kda.gate_lower_bound=float:nan": "finite",  # was "is nan, expected nan"
    "kimi-k3.attention.layer_norm_rms_epsilon=float:1e-50": "rounds to 0",
    "tokenizer.ggml.eos_token_id=int:-3": "0..4294967295",  # was accepted
    "kimi-k3.expert_count=int:1000000": "tensor layout",
    "kimi-k3.context_length=int:1": "exceeds the model's context length",  # -c 64 > 1
}


def _refused(gguf, *args, needle: str) -> None:
    res = run_tool("cli", "-m", gguf, "-p", "hi", "-n", "1", "-c", "64", *args, prelude=NO_GGML)
    res.one_error_line(2, needle)


@pytest.mark.parametrize("kv", BAD_OVERRIDES)
def test_bad_override_is_refused_before_ggml(k31pro_tiny_gguf, kv):
    _refused(k31pro_tiny_gguf, "--override-kv", kv, needle=BAD_OVERRIDES[kv])


BAD_OPTIONS = {
    ("--min-p", "2"): "--min-p must be in [0.0, 1.0]",  # was "Probabilities contain NaN"
    ("--min-p", "nan"): "--min-p must be a finite number",
    ("--top-p", "-0.5"): "--top-p must be in",
    ("--temp", "inf"): "--temp must be a finite number",
    ("--temp=-inf",): "--temp must be a finite number",  # a negative --temp is greedy, as in llama.cpp
    ("--repeat-penalty", "-1"): "--repeat-penalty must be > 0",
    ("--repeat-penalty", "inf"): "--repeat-penalty must be a finite number",
    ("--repeat-penalty", "0"): "--repeat-penalty must be > 0",
    ("--repeat-last-n", "-2"): "--repeat-last-n must be >= -1",
    ("--top-k", "-1"): "--top-k must be >= 0",
    ("-n", "-7"): "-n/--n-predict must be >= -1",
    ("--seed", "-2"): "-s/--seed must be >= -1",
    ("-s", "4294967296"): "-s/--seed must be at most 4294967295",
    ("-t", "0"): "-t/--threads must be >= 1",
    ("--chunks", "3"): "--chunks applies to --perplexity only",
}


@pytest.mark.parametrize("option", BAD_OPTIONS, ids=" ".join)
def test_bad_option_is_refused_before_ggml(k3_tiny_gguf, option):
    _refused(k3_tiny_gguf, *option, needle=BAD_OPTIONS[option])


@pytest.mark.parametrize("chunks", ["0", "-2"])
def test_perplexity_chunks_zero_is_refused(k3_tiny_gguf, tmp_path, chunks):
    text = tmp_path / "t.txt"
    text.write_text("honey " * 200)
    res = run_tool("cli", "-m", k3_tiny_gguf, "--perplexity", "-f", text, "-c", "64", "--chunks", chunks,
                   prelude=NO_GGML)
    res.one_error_line(2, "--chunks must be -1 (all) or >= 1")  # was ZeroDivisionError


def test_threads_beyond_the_cpus_are_capped_with_a_note(k3_tiny_gguf):
    """-t 1000 ran 14 s per token; the run is capped at the CPUs the process may use."""
    import os
    cpus = len(os.sched_getaffinity(0))
    prelude = ("import ggml_graph_spec.engine.model as mm\nreal = mm.Model.__init__\n"
               "def init(self, weights, options):\n    print('threads', options.n_threads, file=sys.stderr)\n"
               "    real(self, weights, options)\nmm.Model.__init__ = init\n")
    res = run_tool("cli", "-m", k3_tiny_gguf, "-p", "hi", "-n", "1", "-c", "64", "--temp", "0", "-t", "1000",
                   prelude=prelude)
    assert res.rc == 0, res.err
    assert f"note: -t 1000 is more than the {cpus} CPU(s) this process may use; using {cpus}" in res.err
    assert f"threads {cpus}\n" in res.err


# ---- hypothesis: any numeric override of any integer or float key ---------------------------

INT_KEYS = ["kimi-k3.attention.indexer.top_k", "kimi-k3.attn_res.block_size", "kimi-k3.expert_used_count",
            "kimi-k3.expert_group_used_count", "kimi-k3.context_length", "tokenizer.ggml.bos_token_id"]
FLOAT_KEYS = ["kimi-k3.expert_weights_scale", "kimi-k3.activation.situ_beta", "kimi-k3.kda.gate_lower_bound",
              "kimi-k3.attention.layer_norm_rms_epsilon"]
HOSTILE_INTS = st.sampled_from([0, -1, 1, 2**31, 2**32, 2**32 - 1, 2**64, -2**63]) | st.integers(-10, 10**6)
HOSTILE_FLOATS = st.sampled_from(["nan", "inf", "-inf", "1e300", "1e-50", "0", "-0.0", "1e38", "4e38"]) | \
    st.floats(allow_nan=False, allow_infinity=False).map(repr)


@settings(FUZZ, max_examples=min(FUZZ.max_examples, 30))  # each example starts a child process
@given(kv=st.one_of(st.tuples(st.sampled_from(INT_KEYS), HOSTILE_INTS).map(lambda t: f"{t[0]}=int:{t[1]}"),
                    st.tuples(st.sampled_from(FLOAT_KEYS), HOSTILE_FLOATS).map(lambda t: f"{t[0]}=float:{t[1]}")))
def test_fuzz_numeric_overrides_are_checked_or_run(k31pro_tiny_gguf, kv):
    """Either a clean refusal before ggml (2), or a run that produces its token (0): never a
    traceback, an abort or a NaN probability."""
    res = run_tool("cli", "-m", k31pro_tiny_gguf, "-p", "hi", "-n", "2", "-c", "64", "--temp", "0.8", "--seed", "1",
                   "--override-kv", kv)
    if res.rc == 0:
        assert "Traceback" not in res.err
        return
    res.one_error_line(2)
