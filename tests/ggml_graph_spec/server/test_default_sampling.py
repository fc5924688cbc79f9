"""kimi-k3-server's sampling flags are the defaults of every request that leaves a field out, as
llama-server's are (-n, --temp, --top-k, --top-p, --min-p, -s, the penalties, --ignore-eos); a
request's own field wins. Checked over HTTP on a live server on the tiny model."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_graph_spec.text.tokenizer import BPETokenizer
from tests.support.server import LiveServer

PROMPT = "[BOS]The old woman sold honey in small"  # the fixtures' short prompt
N = 16  # greedy on this model repeats a token within 16 steps: a strong penalty changes the text


@pytest.fixture(scope="module")
def server(k3_tiny_gguf):
    s = LiveServer(k3_tiny_gguf, "-c", 256, "--exact-experts", "-n", N, "--temp", 1.5, "--top-k", 0, "--top-p", 1.0,
                   "--min-p", 0.0, "-s", 7, "--repeat-penalty", 50, "--ignore-eos")
    yield s
    s.close()


@pytest.fixture(scope="module")
def greedy_text(k3_tiny_gguf, k3_tiny_dir) -> str:
    ids = np.load(k3_tiny_dir / "reference.npz")["greedy_ids"][:N]
    return BPETokenizer.from_gguf(k3_tiny_gguf).decode([int(i) for i in ids])


def _complete(server, **fields) -> dict:
    r = server.http.post("/v1/completions", json={"prompt": PROMPT, "cache_prompt": False, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_request_without_fields_takes_the_servers_flags(server, greedy_text):
    a, b = _complete(server), _complete(server)
    assert a["usage"]["completion_tokens"] == N  # -n, and --ignore-eos: nothing ends it sooner
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # -s 7: the same draw, request after request
    assert a["choices"][0]["text"] != greedy_text  # --temp 1.5 with no filter, or the penalty


def test_the_requests_own_fields_win(server, greedy_text):
    plain = _complete(server, temperature=0, repeat_penalty=1.0, ignore_eos=False)
    assert plain["choices"][0]["text"] == greedy_text
    penalised = _complete(server, temperature=0)  # --repeat-penalty 50 still applies
    assert penalised["choices"][0]["text"] != greedy_text
    assert _complete(server, max_tokens=5)["usage"]["completion_tokens"] == 5
    seeds = {_complete(server, seed=s)["choices"][0]["text"] for s in (7, 8)}
    assert _complete(server)["choices"][0]["text"] in seeds and len(seeds) == 2
