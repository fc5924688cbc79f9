"""llama.cpp's own command-line tools (scripts/build_llama_tools.sh builds them from the pinned
llama-cpp-python sdist) on our GGUFs: llama-cli's greedy tokens, llama-perplexity's PPL,
llama-gguf-split --merge of our split output, and llama-quantize driven by kimi-k3-quantize.

The prompt is the fixture's short prompt, "[BOS]The old woman sold honey in small" (12 tokens:
our GGUFs do not add BOS, the text names it), and the references are k3-tiny's: k31pro-tiny's
base tensors are k3-tiny's bit for bit and --no-dsa drops only the indexer.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

import convert_kimi_k3
from ggml_graph_spec.runner import cli
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.text.tokenizer import BPETokenizer
from tests.support.paths import TEXT

from .llama_tools import llama_bin, llama_cli, run_logged, run_tool

N_GREEDY = 16


@pytest.fixture(autouse=True)
def _tools():
    llama_bin()  # fails under CI=true, skips otherwise, when the tools are not built


@pytest.fixture(scope="module")
def k3_ref(k3_tiny_dir):
    return np.load(k3_tiny_dir / "reference.npz")


@pytest.fixture(scope="module")
def prompt(k3_ref) -> str:
    return str(k3_ref["prompt_short_text"])


def _text(gguf, ids) -> str:
    return BPETokenizer.from_gguf(gguf).decode([int(i) for i in ids])


def _greedy(gguf, prompt: str, *, exact: bool) -> list[int]:
    """Our graph's N_GREEDY greedy tokens after the prompt, through its cache."""
    m = Model.load(gguf, n_ctx=128, exact_experts=exact, n_threads=2)
    try:
        logits, out = m.eval(BPETokenizer.from_gguf(gguf).encode(prompt))[-1], []
        for _ in range(N_GREEDY):
            out.append(int(np.argmax(logits)))
            logits = m.eval([out[-1]])[-1]
        return out
    finally:
        m.close()


def test_the_prompt_tokenizes_to_the_reference_ids(k31pro_no_dsa_gguf, k3_ref, prompt):
    assert BPETokenizer.from_gguf(k31pro_no_dsa_gguf).encode(prompt) == k3_ref["input_ids_short"].tolist()


# ---- llama-cli --------------------------------------------------------------------------------

def test_llama_cli_with_the_exact_settings_prints_the_reference_tokens(k31pro_no_dsa_f32_gguf, k3_ref, prompt,
                                                                       tmp_path):
    # F32 experts and matrices (nothing for ggml to round the activations to), F32 cache, flash
    # attention off: llama.cpp agrees with the reference to its fp32 noise (docs/reference/findings.md), and so
    # does our exact path (tests/interop/test_llama_cpp.py).
    got = llama_cli(k31pro_no_dsa_f32_gguf, prompt, N_GREEDY, tmp_path, "-c", "128", "-ctk", "f32", "-ctv", "f32",
                    "-fa", "off")
    assert got == _text(k31pro_no_dsa_f32_gguf, k3_ref["greedy_ids"])
    assert _greedy(k31pro_no_dsa_f32_gguf, prompt, exact=True) == k3_ref["greedy_ids"].tolist()


def test_llama_cli_defaults_on_the_f32_gguf_print_our_fast_paths_tokens(k31pro_no_dsa_f32_gguf, prompt, tmp_path):
    # Both runtimes' defaults (F16 latent cache, flash attention) on F32 weights: the same
    # roundings, logits within 1e-4 (tests/interop/test_fast_path_f32.py), the same decisions.
    got = llama_cli(k31pro_no_dsa_f32_gguf, prompt, N_GREEDY, tmp_path, "-c", "128")
    assert got == _text(k31pro_no_dsa_f32_gguf, _greedy(k31pro_no_dsa_f32_gguf, prompt, exact=False))


def test_llama_cli_prints_our_fast_paths_tokens_on_the_gguf_as_converted(k31pro_no_dsa_gguf, prompt, tmp_path):
    """MXFP4 experts, BF16 matrices, both runtimes' defaults: the same kernels, the same tokens
    (on AVX512-BF16 CPUs since the fast path rounds as llama.cpp does there; docs/reference/findings.md, "Fast
    path vs llama.cpp on an AVX512-BF16 CPU")."""
    got = llama_cli(k31pro_no_dsa_gguf, prompt, N_GREEDY, tmp_path, "-c", "128")
    assert got == _text(k31pro_no_dsa_gguf, _greedy(k31pro_no_dsa_gguf, prompt, exact=False))


def test_llama_completion_prints_the_reference_tokens_byte_for_byte(k31pro_no_dsa_f32_gguf, k3_ref, prompt):
    # llama-completion is this tree's raw path (no chat template, -no-cnv); it prints each token's
    # bytes as they are, then two newlines. Exact settings as above.
    r = run_logged("llama-completion", "-m", k31pro_no_dsa_f32_gguf, "-p", prompt, "-n", str(N_GREEDY), "--temp", "0",
                   "-c", "128", "-t", "2", "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-no-cnv",
                   "--no-display-prompt", "--special", binary=True, complete=lambda r: r.stdout.endswith(b"\n\n"))
    t = BPETokenizer.from_gguf(k31pro_no_dsa_f32_gguf)
    assert r.stdout == b"".join(t.token_bytes(int(i)) for i in k3_ref["greedy_ids"]) + b"\n\n"


# ---- llama-perplexity -------------------------------------------------------------------------

def _final_ppl(text: str) -> float:
    line = next(line for line in text.splitlines() if "Final estimate: PPL = " in line)
    return float(line.split("PPL = ")[1].split()[0])


def test_llama_perplexity_equals_kimi_k3_cli_perplexity(k31pro_no_dsa_f32_gguf, tmp_path, capsys):
    # Same text, 4 chunks of 64 tokens, the second half of each scored, each chunk from an empty
    # cache starting with BOS; the exact settings on both sides (F32 GGUF; llama.cpp: F32 cache,
    # flash attention off, one sequence per batch; ours: --exact-experts).
    common = ["-c", "64", "--chunks", "4", "-t", "2", "-f", str(TEXT)]
    r = run_logged("llama-perplexity", "-m", k31pro_no_dsa_f32_gguf, *common, "-b", "64", "-ctk", "f32", "-ctv",
                   "f32", "-fa", "off", complete=lambda r: "Final estimate: PPL = " in r.stderr)
    theirs = _final_ppl(r.stderr)
    assert cli.main(["-m", str(k31pro_no_dsa_f32_gguf), "--perplexity", "--exact-experts", *common]) == 0
    ours = _final_ppl(capsys.readouterr().out)
    # With these settings the two runtimes' logits agree to 3e-5 of the largest |logit| (12.7 on
    # this fixture: 4e-4 absolute; test_llama_cpp.py). A token's -log p moves by at most twice its
    # largest logit change, so the mean NLL by at most 8e-4 and the PPL by a factor of at most
    # exp(8e-4): 8e-4 relative, plus the 4-decimal rounding of the printed PPL (~1e-9 here, PPL
    # ~7.5e4 on random weights). Measured: 7.6e-7.
    assert ours == pytest.approx(theirs, rel=8e-4)


# ---- llama-gguf-split --merge -----------------------------------------------------------------

def _ggml_n_dims(ne: list[int]) -> list[int]:
    """ne without its trailing 1s, as ggml_n_dims counts dimensions (at least one)."""
    while len(ne) > 1 and ne[-1] == 1:
        ne = ne[:-1]
    return ne


SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def _kv(reader: GGUFReader) -> dict:
    return {k: (f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_merging_our_split_output_gives_our_unsplit_conversion(tmp_path, k31pro_tiny_dir):
    whole, split = tmp_path / "whole.gguf", tmp_path / "split.gguf"
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), str(whole), "--quiet"]) == 0
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), str(split), "--quiet", "--split-max-tensors", "100"]) == 0
    merged = tmp_path / "merged.gguf"
    run_tool("llama-gguf-split", "--merge", tmp_path / "split-00001-of-00004.gguf", merged)
    a, b = GGUFReader(whole), GGUFReader(merged)
    # The header differs by exactly the three split keys: --merge copies the first part's keys,
    # split.* included (split.count set to 0 so the output is not taken for a split itself).
    kv_a, kv_b = _kv(a), _kv(b)
    assert {k: kv_b.pop(k)[1] for k in SPLIT_KEYS} == {"split.no": 0, "split.count": 0,
                                                      "split.tensors.count": len(a.tensors)}
    assert list(kv_b.items()) == list(kv_a.items())  # every other key, in order, same type and value
    # Tensor infos: same names, order, types and data offsets. The shapes differ only in how
    # they are written: --merge writes ggml_n_dims dimensions, which drops trailing 1s, where we
    # write the table's rank (ssm_conv1d_*: ne {4, 1, n, 1}, 4 dims; merged: 3).
    info = lambda r: [(t.name, t.tensor_type, t.data_offset - r.data_offset) for t in r.tensors]  # noqa: E731
    assert info(b) == info(a)
    ours, theirs = [t.shape.tolist() for t in a.tensors], [t.shape.tolist() for t in b.tensors]
    assert [_ggml_n_dims(ne) for ne in ours] == theirs
    trimmed = [t.name for t, ne in zip(a.tensors, ours) if len(_ggml_n_dims(ne)) < len(ne)]
    assert len(trimmed) == 27 and all(".ssm_conv1d_" in n for n in trimmed)  # q, k, v of 9 KDA layers
    # Everything after the header, every tensor's bytes and padding, is byte for byte the same.
    assert a.data[a.data_offset:].tobytes() == b.data[b.data_offset:].tobytes()
