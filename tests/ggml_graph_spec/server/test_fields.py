"""Nothing a client sends is silently dropped: every field of every endpoint is honoured, accepted
with no effect (the table says why) or refused by name, and the reference page says exactly what
the tables say."""
from __future__ import annotations

import pytest

from ggml_graph_spec.server.fields import CHAT, ENDPOINTS, HONOURED, NO_EFFECT, REFUSED, markdown
from tests.support.paths import REPO
from tests.support.server import LiveServer

PAGE = REPO / "docs/reference/api-fields.md"


def test_the_reference_page_holds_every_table_as_written_from_the_code():
    text = PAGE.read_text(encoding="utf-8")
    assert text.endswith(markdown()), "docs/reference/api-fields.md: rewrite its tables with fields.markdown()"
    for _title, table in ENDPOINTS:
        names = [f.name for f in table]
        assert len(names) == len(set(names)), f"a field listed twice: {names}"
        assert all(f.handling in (HONOURED, NO_EFFECT, REFUSED) and f.doc for f in table)


@pytest.fixture(scope="module")
def server(k3_tiny_gguf):
    s = LiveServer(k3_tiny_gguf, "-np", 1, "-c", 512)
    yield s
    s.close()


def _chat(server, **fields):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **fields}
    return server.http.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("path, body, name", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "frobnicate": 1},
     "frobnicate"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "messages": []}, "messages"),  # another endpoint's field
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1, "max_tokens": 1}, "max_tokens"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "top_logprobs": 2},
     "top_logprobs"),
])
def test_an_unknown_field_is_refused_by_name(server, path, body, name):
    r = server.http.post(path, json=body)
    assert r.status_code == 400 and f"'{name}'" in r.text, r.text


@pytest.mark.parametrize("field, value", [("mirostat", 2), ("functions", [{"name": "f"}]), ("store", True),
                                          ("n_keep", 10), ("modalities", ["audio"])])
def test_a_refused_field_is_a_400_naming_it_unless_it_asks_for_nothing(server, field, value):
    r = _chat(server, **{field: value})
    assert r.status_code == 400 and f"'{field}'" in r.json()["error"]["message"]
    off = next(f for f in CHAT if f.name == field).off
    if off:
        assert _chat(server, **{field: off[0]}).status_code == 200


def test_fields_with_no_effect_are_accepted(server):
    r = _chat(server, user="u1", metadata={"k": "v"}, service_tier="auto", prompt_cache_key="x", model="any")
    assert r.status_code == 200, r.text


def test_logit_bias_is_honoured(server):
    pieces = server.http.post("/tokenize", json={"content": "the", "with_pieces": True}).json()["tokens"]
    forced = _chat(server, temperature=0, logit_bias={str(pieces[0]["id"]): 100}, reasoning_format="none",
                   chat_template_kwargs={"thinking": False})
    assert forced.json()["choices"][0]["message"]["content"] == pieces[0]["piece"]
    r = _chat(server, logit_bias={"-1": 5})
    assert r.status_code == 400 and "'logit_bias'" in r.text
