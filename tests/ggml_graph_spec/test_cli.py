"""kimi-k3-cli end to end on the fixture GGUFs: greedy text, EOS, overrides, DSA switches, errors."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from gguf_arch.errors import EXIT_BAD_INPUT
from ggml_graph_spec.runner.args import parse_override_kv
from ggml_graph_spec.runner.cli import main
from ggml_graph_spec.text.tokenizer import BPETokenizer
from tests.support.paths import REPO

PROMPT = "[BOS]The old woman sold honey in small"  # the fixtures' short prompt


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _greedy(capsys, gguf, *extra, n: int = 16) -> tuple[str, str]:
    rc, out, err = _cli(capsys, "-m", gguf, "-p", PROMPT, "-n", n, "--temp", 0, "-c", 64, "-t", 2,
                        "--exact-experts", *extra)
    assert rc == 0, err
    assert out.startswith(PROMPT)
    return out[len(PROMPT):-1], err  # the generated text, without the closing newline


def _decode(gguf, ids) -> str:
    return BPETokenizer.from_gguf(gguf).decode([int(i) for i in ids])


@pytest.fixture(scope="module")
def k3_ref(k3_tiny_dir):
    return np.load(k3_tiny_dir / "reference.npz")


@pytest.fixture(scope="module")
def k31_ref(k31pro_tiny_dir):
    return np.load(k31pro_tiny_dir / "reference.npz")


def test_greedy_streams_the_reference_continuation(capsys, k3_tiny_gguf, k3_ref):
    text, err = _greedy(capsys, k3_tiny_gguf)
    # The streamed text (token by token through the incremental UTF-8 decoder) is the decode of
    # the reference's 16 greedy ids at once.
    assert text == _decode(k3_tiny_gguf, k3_ref["greedy_ids"])
    for line in ("print_info: arch             = kimi-k3", "print_info: n_layer          = 13 (9 KDA, 4 MLA)",
                 "print_info: DSA layers       = none (plain kimi-k3)",
                 "print_info: n_expert         = 8 (2 used, 2 shared, 1 dense layer(s) first)",
                 "print_info: tensor types     = 165 bf16, 152 f32, 36 mxfp4"):
        assert line in err
    for timing in ("load time", "prompt eval time", "eval time", "total time"):
        assert f"kimi_k3_perf: {timing:>17} = " in err
    assert "/    12 tokens (" in err and "/    15 runs   (" in err


def test_generation_stops_at_the_eos_token(capsys, k3_tiny_gguf, k3_ref):
    # Declaring the 4th greedy token the EOS makes the run stop after three tokens.
    ids = k3_ref["greedy_ids"]
    text, _ = _greedy(capsys, k3_tiny_gguf, "--override-kv", f"tokenizer.ggml.eos_token_id=int:{ids[3]}")
    assert text == _decode(k3_tiny_gguf, ids[:3])


def test_dsa_top_k_override_and_dsa_off(capsys, k31pro_tiny_gguf, k31_ref):
    top8, err = _greedy(capsys, k31pro_tiny_gguf, "--override-kv", "kimi-k3.attention.indexer.top_k=int:8")
    assert top8 == _decode(k31pro_tiny_gguf, k31_ref["topk8__greedy_ids"])
    assert "DSA layers       = [3, 7, 11, 12] (on, top_k 8, gather)" in err
    assert "override         = kimi-k3.attention.indexer.top_k = 8" in err
    masked, err = _greedy(capsys, k31pro_tiny_gguf, "--override-kv", "kimi-k3.attention.indexer.top_k=int:8",
                          "--dsa-path", "masked")
    assert masked == top8
    assert "DSA layers       = [3, 7, 11, 12] (on, top_k 8, masked)" in err
    dense, err = _greedy(capsys, k31pro_tiny_gguf, "--dsa", "off")
    assert dense == _decode(k31pro_tiny_gguf, k31_ref["greedy_ids"])  # top-k 2048 >= every length: dense
    assert "DSA layers       = [3, 7, 11, 12] (off: dense MLA)" in err
    assert top8 != dense


def test_seeded_sampling_is_reproducible(capsys, k3_tiny_gguf):
    args = ("-m", k3_tiny_gguf, "-p", PROMPT, "-n", 6, "-c", 32, "-t", 2, "--temp", 1.5, "--top-k", 0,
            "--top-p", 1.0, "--min-p", 0.0)
    runs = {_cli(capsys, *args, "--seed", s)[1] for s in (5, 5, 6)}
    assert len(runs) == 2


def test_perplexity_mode_prints_llama_perplexity_lines(capsys, tmp_path, k31pro_tiny_gguf, k31_ref):
    text = tmp_path / "text.txt"
    text.write_text(str(k31_ref["prompt_long_text"]).replace("[BOS]", ""), encoding="utf-8")
    base = ("-m", k31pro_tiny_gguf, "--perplexity", "-f", text, "-c", 32, "--chunks", 2, "-t", 2)
    rc, dense, err = _cli(capsys, *base, "--dsa", "off")
    assert rc == 0, err
    lines = dense.splitlines()
    assert lines[0].startswith("[1]") and lines[0].count(",") == 2
    assert lines[1].startswith("Final estimate: PPL = ") and " +/- " in lines[1]
    assert "/    64 tokens (" in err  # prompt eval over both 32-token chunks
    assert "sampling time" not in err
    rc, full, _ = _cli(capsys, *base, "--override-kv", "kimi-k3.attention.indexer.top_k=int:32")
    assert (rc, full) == (0, dense)
    rc, sparse, _ = _cli(capsys, *base, "--override-kv", "kimi-k3.attention.indexer.top_k=int:4")
    assert rc == 0 and sparse != dense


@pytest.mark.parametrize("spec, value", [
    ("kimi-k3.attention.indexer.top_k=int:64", 64), ("a.b=float:0.5", 0.5), ("a=bool:true", True),
    ("a=bool:false", False), ("general.name=str:x=y:z", "x=y:z"),
])
def test_override_kv_syntax(spec, value):
    key, got = parse_override_kv(spec)
    assert got == value and type(got) is type(value) and key == spec.split("=")[0]


@pytest.mark.parametrize("argv, message", [
    (["--override-kv", "kimi-k3.attention.indexer.top_k=int:x"], "'x' is not a int"),
    (["--override-kv", "kimi-k3.attention.indexer.top_k:int=1"], "expected KEY=TYPE:VALUE"),
    (["--override-kv", "kimi-k3.attention.indexer.top_k=u32:1"], "TYPE one of int, float, bool, str"),
    (["--override-kv", "kimi-k3.expert_count=int:4"], "would change the tensor layout"),
    (["--override-kv", "kimi-k3.expert_used_count=float:1.0"], "the file stores a int, the override is a float"),
    (["--override-kv", "kimi-k3.no_such_key=int:1"], "the GGUF has no such key"),
    (["--override-kv", "general.name=str:x"], "not a key this runner reads"),
    (["--repeat-penalty", "0"], "--repeat-penalty must be > 0, got 0.0"),
    (["-s", "-2"], "-s/--seed must be >= -1, got -2"),
    (["--seed", "4294967296"], "-s/--seed must be at most 4294967295"),
    (["--repeat-last-n", "-2"], "--repeat-last-n must be >= -1"),
    (["-no-cnv", "-sys", "be brief"], "-sys applies to a conversation, not with -no-cnv"),
    (["--perplexity", "-cnv"], "it does not run a conversation"),
    (["-c", "4000000"], "exceeds the model's context length 1048576"),
    (["--perplexity"], "--perplexity needs -f FILE"),
    (["-f", "/nonexistent/prompt.txt"], "/nonexistent/prompt.txt: no such file"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, k3_tiny_gguf, argv, message):
    extra = [] if "-f" in argv or "--perplexity" in argv else ["-p", PROMPT]
    extra = ["-f", PROMPT] if "-cnv" in argv else extra
    rc, out, err = _cli(capsys, "-m", k3_tiny_gguf, "-n", 1, "-c", 16, *extra, *argv)
    assert rc == EXIT_BAD_INPUT
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert out == ""


def test_missing_or_broken_model_is_bad_input(capsys, tmp_path):
    rc, _, err = _cli(capsys, "-m", tmp_path / "none.gguf", "-p", "x")
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and "none.gguf: not found" in err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 20)
    rc, _, err = _cli(capsys, "-m", junk, "-p", "x")
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and "junk.gguf" in err


def test_dsa_override_on_a_plain_k3_gguf_is_bad_input(capsys, k3_tiny_gguf):
    rc, _, err = _cli(capsys, "-m", k3_tiny_gguf, "-p", PROMPT, "--override-kv",
                      "kimi-k3.attention.indexer.top_k=int:8")
    assert rc == EXIT_BAD_INPUT and "the GGUF has no such key" in err


def test_split_gguf_runs_from_its_first_file(capsys, tmp_path, k3_tiny_gguf, k3_ref):
    from tests.support.gguf_edit import rewritten_copy  # llama.cpp-style split via gguf-py's writer

    rewritten_copy(k3_tiny_gguf, tmp_path / "split.gguf", split_max_tensors=150)
    first = tmp_path / "split-00001-of-00003.gguf"
    text, _ = _greedy(capsys, first)
    assert text == _decode(k3_tiny_gguf, k3_ref["greedy_ids"])


def test_python_dash_m_is_the_cli_with_its_exit_codes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ggml_graph_spec", "-m", str(tmp_path / "none.gguf"), "-p", "x"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_BAD_INPUT
    assert r.stdout == "" and r.stderr.count("\n") == 1 and "none.gguf: not found" in r.stderr


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_model_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    """np.memmap (under gguf-py) opens the path itself, and a FIFO would block that open forever:
    refused before, in a child process with a timeout so that a regression fails, not hangs."""
    model = tmp_path / "model.gguf"
    os.mkfifo(model) if kind == "fifo" else model.mkdir()
    r = subprocess.run([sys.executable, "-m", "ggml_graph_spec", "-m", str(model), "-p", "x"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_BAD_INPUT and r.stderr.count("\n") == 1, r.stderr
    assert f"{model}: " in r.stderr and ("not a regular file" if kind == "fifo" else "is a directory") in r.stderr


def test_a_full_context_ends_generation(capsys, tmp_path, k3_tiny_gguf, k3_ref):
    # 12 prompt tokens in a 16-token context: 4 more tokens fill it, and a 5th is still sampled
    # from the last position's logits (it needs no cache slot).
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT, encoding="utf-8")
    rc, out, err = _cli(capsys, "-m", k3_tiny_gguf, "-f", prompt, "--no-display-prompt", "--temp", 0, "-c", 16,
                        "-t", 2, "--exact-experts")
    assert rc == 0, err
    assert out == _decode(k3_tiny_gguf, k3_ref["greedy_ids"][:5]) + "\n"
