"""The server's own OpenAPI schema (GET /openapi.json, written from fields.py and limits.py) given
to schemathesis: a few hundred requests over every endpoint, valid by the schema and invalid
(one part broken at a time), derandomized (the same cases on every run). Every answer is below
500; every 4xx is an error object (Anthropic's on /v1/messages); afterwards nothing was logged
but lines, every slot is free, and the next greedy reply is the one from before.

Generation lengths above 4 tokens (and -1, the whole context) are set to 4, so that hundreds of
cases run in about a minute: the lengths' own ranges are checked by the invalid cases and by
test_request_limits.py. KIMI_API_FUZZ_EXAMPLES fuzzes longer."""
from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.support.server import WAIT_S, LiveServer, LogRecords, wait_for

EXAMPLES = int(os.environ.get("KIMI_API_FUZZ_EXAMPLES", "300"))
LENGTHS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")
GREEDY = {"prompt": "Bees", "max_tokens": 6, "temperature": 0, "cache_prompt": False}


@pytest.fixture(scope="module")
def server(k3_tiny_gguf, tmp_path_factory):
    s = LiveServer(k3_tiny_gguf, "-np", 2, "-c", 2 * 384, "-n", 4, "--slot-save-path",
                   tmp_path_factory.mktemp("slots"))
    yield s
    s.close()


def _short(body) -> None:
    """Valid generation lengths past 4 (or -1) become 4; invalid ones stay as the fuzzer made them."""
    if not isinstance(body, dict):
        return
    for name in LENGTHS:
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and (v == -1 or 4 < v <= 2**63 - 1):
            body[name] = 4


def _is_error_object(path: str, body) -> bool:
    if path.startswith("/v1/messages"):
        return isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict) \
            and isinstance(body["error"].get("message"), str) and isinstance(body["error"].get("type"), str)
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("code"), int) \
        and isinstance(error.get("type"), str)


def test_every_endpoint_answers_every_request_the_schema_makes_with_a_reply_or_an_error_object(server):
    before = server.http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    # Each operation gets its share of the cases: one strategy over all of them left some endpoint
    # undrawn on some runs (the draw order follows the schema's set iteration, which moves with
    # the hash seed), and every endpoint must be tried on every run.
    per_operation = max(2, EXAMPLES // len(operations))
    seen: dict = {}

    def call(case) -> None:
        _short(case.body)
        r = case.call(base_url=server.url, timeout=WAIT_S)
        seen[case.operation.path, r.status_code // 100] = seen.get((case.operation.path, r.status_code // 100), 0) + 1
        assert r.status_code < 500, (case.operation.path, case.body, r.text[:500])
        if r.status_code >= 400:
            assert _is_error_object(case.operation.path, r.json()), (case.operation.path, r.text[:500])

    with LogRecords() as logs:
        for operation in operations:
            cases = st.one_of(operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
                              operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
            settings(max_examples=per_operation, derandomize=True, database=None, deadline=None,
                     suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])(
                given(cases)(call))()
    assert {path for path, _ in seen} == {op.ok().path for op in schema.get_all_operations()}, seen
    assert {kind for _, kind in seen} == {2, 4}, seen
    assert not logs.tracebacks() and not server.tracebacks(), (logs.tracebacks(), server.tracebacks())
    assert not [line for line in server.log if line.startswith("error")]
    wait_for(server.idle, "every slot free")
    assert server.http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == before
