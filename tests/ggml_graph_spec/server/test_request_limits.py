"""The numbers and the JSON a request may hold, without a server: every numeric field's range from
limits.py (integers past int64, numbers past float32 or not finite: a 400 naming the field; the
counts that mean "the context" clamped), the sampler giving a token for any value in range, the
body's JSON rules (depth, duplicate keys), and the OpenAPI schema written from the same tables."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ggml_graph_spec.generation.sampling import Sampler, SamplingParams
from ggml_graph_spec.server import bodies, fields, limits, openapi
from ggml_graph_spec.server.app import HttpSettings, Server, build_app
from ggml_graph_spec.server.errors import ApiError
from ggml_graph_spec.server.protocol import gen_request
from tests.fuzz.harness import FUZZ
from tests.support.paths import REPO

VOCAB = 1000
INTEGERS = [n for n, r in limits.RANGES.items() if r.integer and n not in ("n", "reasoning_budget_tokens",
                                                                             "thinking_budget_tokens",
                                                                             "max_output_tokens")]
NUMBERS = [n for n, r in limits.RANGES.items() if not r.integer and n != "logit_bias"]


CHAT_ONLY = {"max_completion_tokens": {}, "top_logprobs": {"logprobs": True}}  # fields of chat requests only


def _gen(**body):
    chat = next(({**body, **more} for name, more in CHAT_ONLY.items() if name in body), None)
    return gen_request(chat or body, [1, 2], chat is not None, 0, vocab=VOCAB)


def _refused(**body) -> str:
    with pytest.raises(ApiError) as exc:
        _gen(**body)
    assert exc.value.status == 400 and "\n" not in exc.value.message
    return exc.value.message


@pytest.mark.parametrize("name", INTEGERS)
@pytest.mark.parametrize("past", ["high + 1", "10**30", "low - 1", "-2**63 - 1"])
def test_an_integer_past_its_range_is_a_400_naming_the_field(name, past):
    r = limits.RANGES[name]
    value = eval(past, {"high": r.high, "low": r.low})  # noqa: S307 - the four edges above
    assert f"'{name}' must be" in _refused(**{name: value})


@pytest.mark.parametrize("name", NUMBERS)
@pytest.mark.parametrize("value", [1e39, -1e39, 10**400, float("nan"), float("inf"), -float("inf")])
def test_a_number_past_float32_or_not_finite_is_a_400_naming_the_field(name, value):
    assert f"'{name}' must be" in _refused(**{name: value})


@pytest.mark.parametrize("value, window", [(-1, limits.ALL_TOKENS), (2**63 - 1, limits.ALL_TOKENS),
                                           (2**31, limits.ALL_TOKENS), (0, 0), (64, 64)])
def test_repeat_last_n_minus_one_or_past_any_context_is_the_whole_context(value, window):
    assert _gen(repeat_last_n=value).sampling.repeat_last_n == window
    Sampler(_gen(repeat_last_n=value).sampling).accept([1, 2, 3])  # a deque the platform can hold


def test_an_integral_float_is_its_integer_and_any_other_float_a_400():
    """4.0 is an integer to JSON Schema (and OpenAI's API): the fuzzer writes such, clients too."""
    assert _gen(max_tokens=4.0, top_k=40.0).max_tokens == 4
    assert "'top_k' must be an integer, got float 1.5" in _refused(top_k=1.5)
    assert "'seed' must be in" in _refused(seed=1e300)
    assert "'repeat_last_n' must be an integer" in _refused(repeat_last_n=float("nan"))


def test_counts_up_to_int64_are_taken_and_clamped_later():
    r = _gen(top_k=2**63 - 1, max_tokens=2**63 - 1, seed=2**64 - 1)
    assert r.sampling.top_k == 2**63 - 1 and r.max_tokens == 2**63 - 1 and r.sampling.seed == 2**64 - 1


@pytest.mark.parametrize("bias, needle", [
    ({"²": 1}, "is not a token id"), ({"1" * 5000: 1}, "is not a token id"), ({"5": 10**400}, "'logit_bias[5]'"),
    ({str(i): -100 for i in range(VOCAB)}, "bans every token"),
])
def test_logit_bias_keys_and_values_that_are_no_numbers_the_engine_holds(bias, needle):
    assert needle in _refused(logit_bias=bias)


@FUZZ
@given(temp=st.floats(0, limits.FLOAT32_MAX), penalty=st.floats(0, limits.FLOAT32_MAX, exclude_min=True),
       presence=st.floats(-2, 2), min_p=st.floats(0, 1), top_p=st.floats(0, 1),
       top_k=st.integers(0, 2**63 - 1), seed=st.integers(0, 2**64 - 1), suppress=st.sets(st.integers(0, 49), max_size=49))
def test_the_sampler_gives_an_allowed_token_for_any_value_in_range(temp, penalty, presence, min_p, top_p, top_k,
                                                                   seed, suppress):
    """1e-300 temperatures, 1e38 penalties, min_p 5e-324 were NaN probabilities (a ValueError in
    the engine thread); now each a token that was not suppressed."""
    params = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, repeat_penalty=penalty,
                            repeat_last_n=limits.ALL_TOKENS, presence_penalty=presence, frequency_penalty=presence,
                            suppress=frozenset(suppress))
    sampler = Sampler(params)
    sampler.accept(range(0, 50, 3))
    logits = np.random.default_rng(seed % 2**32).normal(0, 30, 50).astype(np.float32)
    for _ in range(3):
        token = sampler(logits)
        assert 0 <= token < 50 and token not in suppress
        sampler.accept([token])


# ---- the body's JSON ------------------------------------------------------------------------------

def _parse_refused(data: bytes) -> str:
    with pytest.raises(ApiError) as exc:
        bodies.parse(data)
    assert exc.value.status == 400
    return exc.value.message


def test_nesting_to_the_bound_is_taken_and_past_it_refused_whatever_the_depth():
    deep = lambda n: b"[" * n + b"]" * n  # noqa: E731
    assert bodies.parse(b'{"a": ' + deep(bodies.MAX_DEPTH - 1) + b"}")
    for n in (bodies.MAX_DEPTH + 1, 5000, 200_000):
        assert "nested deeper than 64 levels" in _parse_refused(b'{"a": ' + deep(n) + b"}")


@pytest.mark.parametrize("data, key", [
    (b'{"model": "a", "model": "b"}', "'model'"),
    (b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}', "'role'"),
    (b'{"a": {"\\u00e9": 1, "\\u00e9": 2}}', "'\u00e9'"),
])
def test_a_key_twice_in_one_object_is_refused_naming_it(data, key):
    assert f"the request body has the key {key} twice" in _parse_refused(data)


def test_the_same_key_in_two_objects_is_no_duplicate():
    assert bodies.parse(b'[{"a": 1}, {"a": 2}]') == [{"a": 1}, {"a": 2}]


# ---- the schema -----------------------------------------------------------------------------------

def test_the_ranges_table_in_the_docs_is_the_code_s():
    assert limits.markdown() in (REPO / "docs/reliability.md").read_text(encoding="utf-8"), \
        "docs/reliability.md: paste limits.markdown()"


def test_the_schema_holds_every_field_of_every_table_with_the_code_s_ranges():
    doc = openapi.document()
    paths = {"POST /v1/chat/completions": "/v1/chat/completions", "POST /v1/completions": "/v1/completions",
             "POST /v1/responses": "/v1/responses", "POST /v1/messages": "/v1/messages"}
    for title, table in fields.ENDPOINTS:
        props = doc["paths"][paths[title]]["post"]["requestBody"]["content"]["application/json"]["schema"]
        props = props["properties"]
        for f in table:
            if f.handling == fields.REFUSED:
                assert props.get(f.name, {"enum": list(f.off)}) == {"enum": list(f.off)}, f.name
            else:
                assert f.name in props, f"{title}: {f.name} has no schema (openapi.py)"
        for name, r in limits.RANGES.items():
            if name in props and "type" in props[name] and props[name]["type"] in ("integer", "number"):
                assert props[name] == r.schema(), name
    json.dumps(doc)  # JSON through and through


def test_the_schema_describes_every_route_the_server_has():
    routes = _routes(build_app(Server(HttpSettings("k3", None, 1 << 20, 10.0, None), print)))
    # aliases of described routes, and the routes that take no request body (the page, its icon, the schema)
    aliases = {"/chat/completions", "/completions", "/responses", "/models", "/v1/health", "/", "/favicon.ico",
               "/openapi.json"}
    assert routes - aliases == set(openapi.document()["paths"])


def _routes(app) -> set[str]:
    while not hasattr(app, "routes"):  # the ASGI layers around FastAPI
        app = app.app
    return {r.path for r in app.routes if getattr(r, "methods", None)}


def test_a_float32_bound_is_float32_s_largest():
    assert np.float32(limits.FLOAT32_MAX) == np.finfo(np.float32).max and math.isfinite(np.float32(limits.FLOAT32_MAX))
