"""kimi-k3-server's API against a live server on loopback: the official `openai` client and plain
HTTP (httpx); greedy replies equal kimi-k3-cli's for the same prompt and template; the prompt
cache's replies equal those computed from scratch; every hostile input is one OpenAI error and
the server serves the next request."""
from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cli import run_runner
from tests.support.server import LiveServer

PROMPT = "[BOS]The old woman sold honey in small"  # the fixtures' short prompt
N_CTX_SLOT = 512


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(k3_tiny_gguf, slot_dir):
    s = LiveServer(k3_tiny_gguf, "-np", 2, "-c", 2 * N_CTX_SLOT, "--exact-experts", "--slot-save-path", slot_dir)
    yield s
    s.close()


def _chat(client, content: str, n: int = 6, **extra):
    return client.chat.completions.create(model="k3", messages=[{"role": "user", "content": content}],
                                          max_tokens=n, temperature=0, **extra)


def _metrics(server) -> dict[str, float]:
    text = server.http.get("/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


# ---- the same replies as kimi-k3-cli ---------------------------------------------------------------

def test_chat_reply_equals_the_cli_conversation(server, client, k3_tiny_gguf):
    # reasoning_format none: the think channel's text stays in the reply's text, as the CLI prints it
    cli = run_runner("-m", k3_tiny_gguf, "-cnv", "-p", "Hello there", "-n", 6, "--temp", 0, "-c", 1024,
                     "-t", 2, "--exact-experts", "--reasoning-format", "none", stdin="")
    assert cli.returncode == 0, cli.stderr
    r = _chat(client, "Hello there", extra_body={"reasoning_format": "none"})
    assert r.choices[0].message.content + "\n" == cli.stdout
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_equals_the_cli_completion(server, client, k3_tiny_gguf):
    cli = run_runner("-m", k3_tiny_gguf, "-p", PROMPT, "-n", 16, "--temp", 0, "-c", 1024, "-t", 2,
                     "--exact-experts")
    assert cli.returncode == 0, cli.stderr
    r = client.completions.create(model="k3", prompt=PROMPT, max_tokens=16, temperature=0)
    assert PROMPT + r.choices[0].text + "\n" == cli.stdout
    ids = server.http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model="k3", prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text  # a prompt of token ids is the same prompt


def test_streaming_gives_the_same_text_and_ends_with_usage(server, client):
    whole = _chat(client, "Tell me", n=8).choices[0].message.content
    chunks = list(_chat(client, "Tell me", n=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    raw = server.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}).text
    assert raw.endswith("data: [DONE]\n\n") and raw.startswith("data: {")


def test_models_lists_the_alias_and_health_is_ok(server, client):
    assert [m.id for m in client.models.list().data] == ["k3-tiny.gguf"]
    assert server.http.get("/health").json() == {"status": "ok"}
    assert server.http.get("/props").json()["total_slots"] == 2


def test_logprobs_are_the_model_distribution(server, client):
    # Every sampled token has its entry, the think channel's too: with reasoning_format none the reply's
    # text is all of them.
    r = _chat(client, "Hello there", logprobs=True, top_logprobs=3, extra_body={"reasoning_format": "none"})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content  # no special token in this reply
    for e in content:  # greedy: the sampled token is the most likely one
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == e.logprob and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    legacy = client.completions.create(model="k3", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    assert len(legacy.choices[0].logprobs.tokens) == 4 and len(legacy.choices[0].logprobs.top_logprobs[0]) == 2


def test_a_stop_string_ends_the_reply_before_it(server, client):
    text = client.completions.create(model="k3", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip() and text.find(stop) > 0
    r = client.completions.create(model="k3", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="k3", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


# ---- the prompt cache ------------------------------------------------------------------------------

def test_the_next_turn_is_served_from_the_cache_with_the_reply_from_scratch(server, client):
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    a = client.chat.completions.create(model="k3", messages=first, max_tokens=5, temperature=0)
    turn = first + [{"role": "assistant", "content": a.choices[0].message.content},
                    {"role": "user", "content": "And another?"}]
    hits = _metrics(server)["kimi_k3:prompt_cache_hits_total"]
    cached = client.chat.completions.create(model="k3", messages=turn, max_tokens=6, temperature=0)
    fresh = client.chat.completions.create(model="k3", messages=turn, max_tokens=6, temperature=0,
                                           extra_body={"cache_prompt": False})
    assert a.usage.prompt_tokens <= cached.usage.prompt_tokens_details.cached_tokens < cached.usage.prompt_tokens
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert cached.choices[0].message.content == fresh.choices[0].message.content
    assert _metrics(server)["kimi_k3:prompt_cache_hits_total"] == hits + 1


def test_a_completion_continued_reuses_the_whole_history(server, client):
    ids = server.http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    a = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                  "logprobs": 0}).json()
    more = ids + [t for t in server.http.post("/tokenize", json={"content": a["choices"][0]["text"]}).json()["tokens"]]
    b = server.http.post("/v1/completions", json={"prompt": more + [ids[-1]], "max_tokens": 4, "temperature": 0}).json()
    fresh = server.http.post("/v1/completions", json={"prompt": more + [ids[-1]], "max_tokens": 4, "temperature": 0,
                                                      "cache_prompt": False}).json()
    # The slot holds the prompt and the reply but its last sampled token: all of that is reused.
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids)
    assert b["choices"][0]["text"] == fresh["choices"][0]["text"]


def test_a_slot_saved_erased_and_restored_serves_the_next_prompt_from_its_file(server, slot_dir):
    for sid in (0, 1):
        server.http.post(f"/slots/{sid}?action=erase").raise_for_status()
    ids = server.http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    a = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0}).json()
    (slot,) = [s for s in server.slots() if s["n_tokens"]]
    saved = server.http.post(f"/slots/{slot['id']}?action=save", json={"filename": "a.bin"}).json()
    assert saved["n_saved"] == slot["n_tokens"] == len(ids) + 3  # the prompt and the reply but its last token
    assert (slot_dir / "a.bin").stat().st_size == saved["n_written"]
    assert server.http.post(f"/slots/{slot['id']}?action=erase").json()["n_erased"] == saved["n_saved"]
    assert server.slots()[slot["id"]]["n_tokens"] == 0
    restored = server.http.post(f"/slots/{slot['id']}?action=restore", json={"filename": "a.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"] and server.slots()[slot["id"]]["n_tokens"] == saved["n_saved"]
    history = ids + [t for t in server.http.post("/tokenize", json={"content": a["choices"][0]["text"]}).json()["tokens"]]
    body = {"prompt": history[:saved["n_saved"]] + [ids[0]], "max_tokens": 3, "temperature": 0}
    cached = server.http.post("/v1/completions", json=body).json()
    fresh = server.http.post("/v1/completions", json={**body, "cache_prompt": False}).json()
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] == saved["n_saved"]
    assert cached["choices"][0]["text"] == fresh["choices"][0]["text"]


@pytest.mark.parametrize("query, body, needle", [
    ("0?action=save", {"filename": "../escape.bin"}, "'filename' must be a plain file name"),
    ("0?action=restore", {"filename": "missing.bin"}, "cannot read the sequence state"),
    ("0?action=restore", {"filename": "junk.bin"}, "not a kimi-k3 sequence state"),
    ("0?action=fly", {}, "action must be one of save, restore, erase"),
    ("7?action=erase", {}, "slot id must be 0..1"),
])
def test_bad_slot_actions_are_400_and_leave_the_slot_as_it_was(server, slot_dir, query, body, needle):
    (slot_dir / "junk.bin").write_bytes(b"not a state at all" * 10)
    before = server.slots()
    r = server.http.post(f"/slots/{query}", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert str(slot_dir) not in r.text  # the server's directory is not told to clients
    assert server.slots() == before


# ---- tokens, metrics -------------------------------------------------------------------------------

def test_tokenize_and_detokenize_round_trip(server):
    ids = server.http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    assert server.http.post("/detokenize", json={"tokens": ids}).json() == {"content": PROMPT}
    pieces = server.http.post("/tokenize", json={"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == PROMPT


def test_metrics_use_llama_server_names_with_the_kimi_k3_prefix(server, client):
    before = _metrics(server)
    r = _chat(client, "Count", n=3)
    after = _metrics(server)
    assert after["kimi_k3:tokens_predicted_total"] == before["kimi_k3:tokens_predicted_total"] + 3
    assert after["kimi_k3:prompt_tokens_total"] - before["kimi_k3:prompt_tokens_total"] == \
        r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
    assert after["kimi_k3:requests_processing"] == 0 and after["kimi_k3:requests_deferred"] == 0
    for name in ("prompt_seconds_total", "n_decode_total", "predicted_tokens_seconds", "prompt_tokens_seconds",
                 "n_busy_slots_per_decode", "slots_busy", "prompt_cache_tokens_total"):
        assert "kimi_k3:" + name in after


# ---- limits and hostile input ------------------------------------------------------------------------

def test_max_tokens_in_the_billions_is_clamped_to_the_context(server):
    ids = server.http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    prompt = (ids * N_CTX_SLOT)[:N_CTX_SLOT - 8]  # 8 rows of the slot left
    r = server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4_000_000_000, "temperature": 0,
                                                  "ignore_eos": True, "cache_prompt": False}).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 8 + 1  # the last token sampled needs no cache row


def test_a_prompt_over_the_context_is_refused_before_any_work(server):
    before = _metrics(server)
    r = server.http.post("/v1/completions", json={"prompt": [1] * N_CTX_SLOT, "max_tokens": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_prompt_tokens"] == N_CTX_SLOT
    assert err["n_ctx"] == N_CTX_SLOT
    after = _metrics(server)
    assert after["kimi_k3:requests_total"] == before["kimi_k3:requests_total"]
    assert after["kimi_k3:n_decode_total"] == before["kimi_k3:n_decode_total"]


GOOD = {"prompt": PROMPT, "max_tokens": 2}
HOSTILE = [
    ("invalid JSON", b'{"prompt": "x", ', 400, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, "must be a JSON object"),
    ("prompt of a wrong type", {"prompt": 5}, 400, "'prompt' is required"),
    ("max_tokens a string", {**GOOD, "max_tokens": "10"}, 400, "'max_tokens' must be an integer"),
    ("temperature a boolean", {**GOOD, "temperature": True}, 400, "'temperature' must be a number"),
    ("negative temperature", {**GOOD, "temperature": -1}, 400, "'temperature' must be >= 0.0"),
    ("NaN top_p", b'{"prompt": "x", "top_p": NaN}', 400, "'top_p' must be a finite number"),
    ("infinite min_p", b'{"prompt": "x", "min_p": Infinity}', 400, "'min_p' must be a finite number"),
    ("negative top_k", {**GOOD, "top_k": -3}, 400, "'top_k' must be >= 0"),
    ("zero repeat penalty", {**GOOD, "repeat_penalty": 0}, 400, "'repeat_penalty' must be > 0.0"),
    ("presence penalty out of range", {**GOOD, "presence_penalty": 9}, 400, "'presence_penalty' must be in"),
    ("n of 2", {**GOOD, "n": 2}, 400, "'n' must be 1"),
    ("token id out of range", {"prompt": [1, 10**9]}, 400, "token id 1000000000 is outside the vocabulary"),
    ("negative token id", {"prompt": [-1]}, 400, "token id -1 is outside"),
    ("several prompts", {"prompt": ["a", "b"]}, 400, "several prompts"),
    ("stop of a wrong type", {**GOOD, "stop": [1]}, 400, "'stop' must be"),
    ("seed out of range", {**GOOD, "seed": -5}, 400, "'seed' must be in"),
    ("bytes that are not UTF-8", b'{"prompt": "hi \xff"}', 400, "not valid JSON"),
    ("a lone surrogate", b'{"prompt": "hi \\ud800"}', 400, "'prompt' is not valid Unicode"),
]
HOSTILE_CHAT = [
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "'messages[0].role' must be one of"),
    ("no messages", {"messages": []}, 400, "'messages' is required"),
    ("content of a wrong type", {"messages": [{"role": "user", "content": 7}]}, 400, "must be a string or a list"),
    ("an image without --mmproj", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                             "image_url": {"url": "x"}}]}]},
     400, "'messages[0].content[0]' is an image: this server has no vision encoder"),
    ("an audio part", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     400, "renders text, image and video parts, not input_audio"),
    ("top_logprobs over 20", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
     400, "'top_logprobs' must be in [0, 20]"),
    ("a reserved template kwarg", {"messages": [{"role": "user", "content": "x"}],
                                   "chat_template_kwargs": {"bos_token": "<evil>", "thinking": False}},
     400, "'chat_template_kwargs' may not set 'bos_token'"),
    ("a lone surrogate in a message", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "'messages[0].content' is not valid Unicode"),
    ("messages as a template kwarg", {"messages": [{"role": "user", "content": "x"}],
                                      "chat_template_kwargs": {"messages": 5}},
     400, "'chat_template_kwargs' may not set 'messages'"),
]


def _post(server, path: str, body) -> "httpx.Response":  # noqa: F821
    if isinstance(body, bytes):
        return server.http.post(path, content=body, headers={"content-type": "application/json"})
    return server.http.post(path, json=body)


@pytest.mark.parametrize("path, case", [("/v1/completions", c) for c in HOSTILE] +
                         [("/v1/chat/completions", c) for c in HOSTILE_CHAT], ids=lambda x: x[0] if isinstance(x, tuple) else x)
def test_hostile_input_is_one_openai_error_and_the_server_goes_on(server, path, case):
    _name, body, status, needle = case
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == "invalid_request_error" and needle in err["message"], err
    assert "\n" not in err["message"] and "Traceback" not in r.text
    ok = server.http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_50_mb_body_is_413_and_the_server_goes_on(server):
    body = json.dumps({"prompt": "x" * (50 * 2**20)}).encode()
    r = server.http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert "at most 20971520 (--max-body)" in r.json()["error"]["message"]
    assert server.http.post("/v1/completions", json=GOOD).status_code == 200


def test_unknown_paths_and_methods_are_openai_errors(server):
    r = server.http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = server.http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_the_chat_page_and_its_files_are_served_by_the_server(server):
    page = server.http.get("/")
    assert page.status_code == 200 and "<title>kimi-k3-server</title>" in page.text
    for asset in ("/static/chat.js", "/static/chat.css"):
        assert server.http.get(asset).status_code == 200
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
