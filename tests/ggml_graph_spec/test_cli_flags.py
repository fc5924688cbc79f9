"""The llama-cli flags people type, run as a user runs them (a child process): -cnv (never `-c nv`),
-s, the printed seed, --ignore-eos, --version, --temp <= 0, -r, --repeat-penalty, Ctrl-C timings."""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import ggml
import numpy as np
import pytest

from gguf_arch.errors import EXIT_INTERRUPTED
from ggml_graph_spec.runner.cli import build_parser, run_mode
from ggml_graph_spec.text.tokenizer import BPETokenizer

from tests.support.cli import run_runner as cli
from tests.support.paths import REPO

PROMPT = "[BOS]The old woman sold honey in small"  # the fixtures' short prompt
SAMPLED = ("--temp", "1.5", "--top-k", "0", "--top-p", "1.0", "--min-p", "0.0")


def complete(gguf, *argv, n: int = 6) -> subprocess.CompletedProcess:
    r = cli("-m", gguf, "-p", PROMPT, "-n", n, "-c", 64, "-t", 2, "--exact-experts", "--no-display-prompt", *argv)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def greedy_ids(k3_tiny_dir):
    return np.load(k3_tiny_dir / "reference.npz")["greedy_ids"]


def _decode(gguf, ids) -> str:
    return BPETokenizer.from_gguf(gguf).decode([int(i) for i in ids])


@pytest.mark.parametrize("argv, mode", [
    (["-cnv"], "chat"), (["-i"], "chat"), ([], "chat"), (["-p", "x"], "complete"), (["-p", "x", "-cnv"], "chat"),
    (["-p", "x", "-i", "-no-cnv"], "interactive"), (["-sys", "s"], "chat"), (["-f", "x", "--perplexity"], "perplexity"),
])
def test_the_mode_follows_llama_cli(argv, mode):
    args = build_parser().parse_args(["-m", "m.gguf", *argv])
    assert run_mode(args) == mode
    assert args.ctx_size == 4096  # -cnv is an option of its own, never -c with the value "nv"


def test_seed_alias_and_the_printed_random_seed_repeat_a_run(k3_tiny_gguf):
    drawn = complete(k3_tiny_gguf, *SAMPLED)
    (line,) = [l for l in drawn.stderr.splitlines() if l.startswith("sampler seed: ")]
    seed = int(line.removeprefix("sampler seed: "))
    assert 0 <= seed < 2**32
    again, long_form = complete(k3_tiny_gguf, *SAMPLED, "-s", seed), complete(k3_tiny_gguf, *SAMPLED, "--seed", seed)
    assert drawn.stdout == again.stdout == long_form.stdout
    assert f"sampler seed: {seed}\n" in again.stderr


def test_temp_at_or_below_zero_is_greedy(k3_tiny_gguf, greedy_ids):
    want = _decode(k3_tiny_gguf, greedy_ids[:6]) + "\n"
    assert complete(k3_tiny_gguf, "--temp", "-1").stdout == want
    assert complete(k3_tiny_gguf, "--temp", "0").stdout == want


def test_ignore_eos_never_samples_it(k3_tiny_gguf, greedy_ids):
    eos = f"tokenizer.ggml.eos_token_id=int:{greedy_ids[3]}"
    stopped = complete(k3_tiny_gguf, "--temp", "0", "--override-kv", eos)
    assert stopped.stdout == _decode(k3_tiny_gguf, greedy_ids[:3]) + "\n"
    ignored = complete(k3_tiny_gguf, "--temp", "0", "--override-kv", eos, "--ignore-eos")
    assert ignored.stdout.startswith(_decode(k3_tiny_gguf, greedy_ids[:3]))
    assert ignored.stdout != _decode(k3_tiny_gguf, greedy_ids[:6]) + "\n"  # the EOS (4th greedy token) was banned
    assert "/     6 runs" in ignored.stderr  # six tokens sampled: -n, not the EOS, ended the run


def test_a_reverse_prompt_stops_the_completion(k3_tiny_gguf, greedy_ids):
    text = _decode(k3_tiny_gguf, greedy_ids[:6])
    third = _decode(k3_tiny_gguf, greedy_ids[2:3])
    assert third and third not in _decode(k3_tiny_gguf, greedy_ids[:2])
    r = complete(k3_tiny_gguf, "--temp", "0", "-r", third)
    assert r.stdout == _decode(k3_tiny_gguf, greedy_ids[:3]) + "\n" and r.stdout != text + "\n"


def test_repeat_penalty_changes_greedy_text_only_when_on(k3_tiny_gguf, greedy_ids):
    plain = _decode(k3_tiny_gguf, greedy_ids[:16]) + "\n"
    assert complete(k3_tiny_gguf, "--temp", "0", "--repeat-penalty", "1.0", n=16).stdout == plain
    # Greedy on this model repeats tokens within 16 steps, so a strong penalty over the window must change it.
    assert len(set(greedy_ids[:16].tolist())) < 16
    assert complete(k3_tiny_gguf, "--temp", "0", "--repeat-penalty", "50", n=16).stdout != plain
    assert complete(k3_tiny_gguf, "--temp", "0", "--repeat-penalty", "50", "--repeat-last-n", "0", n=16).stdout == plain


def test_version_needs_no_model():
    r = cli("--version")
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith("kimi-k3-cli 0.1.0")
    assert lines[1].startswith(f"ggml {ggml.ggml_version().decode()} (ggml-python ")
    assert lines[2].startswith("llama.cpp ")


def _read_until(proc: subprocess.Popen, stream, predicate, limit_s: float = 300) -> str:
    """Bytes from a child's pipe until predicate(text) holds; the limit only guards against a hang."""
    seen, deadline = b"", time.monotonic() + limit_s
    fd = stream.fileno()
    while not predicate(seen.decode("utf-8", "replace")):
        assert time.monotonic() < deadline and proc.poll() is None, seen
        if select.select([fd], [], [], 1.0)[0]:
            seen += os.read(fd, 4096)
    return seen.decode("utf-8", "replace")


def test_ctrl_c_during_generation_prints_the_timings_and_exits_130(k3_tiny_gguf):
    # --ignore-eos and a 4096-token context: the reply cannot end by itself before the signal.
    proc = subprocess.Popen([sys.executable, "-m", "ggml_graph_spec", "-m", str(k3_tiny_gguf), "-p", "Hello",
                             "--ignore-eos", "-c", "4096", "-t", "2"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        _read_until(proc, proc.stdout, lambda text: len(text) > len("Hello") + 2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "kimi_k3_perf:         eval time = " in err and "kimi_k3_perf:        total time = " in err
    assert err.splitlines()[-1] == "error: interrupted (SIGINT)"
    runs = int(re.search(r"eval time = .* / +(\d+) runs", err).group(1))
    assert 0 < runs < 4096
