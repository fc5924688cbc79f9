"""One request's fault is that request's, never the engine's: an exception while a job starts, is
sampled, is parsed or ends fails THAT job with a 500 error object (one log line) and frees and
empties its slot; a fault of a step fails that step's jobs; a fault in a handler is a 500 object
and one log line, no traceback. The engine serves on, and the next greedy reply is the same as
before. (A `repeat_last_n` of 2^63 ended the engine thread: its deque could not hold the count.)

Faults are injected in the test's own process at a chosen point (a marker seed picks the job);
the engine's steps are gated where the order matters."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from ggml_graph_spec.generation import sampling
from ggml_graph_spec.server import engine as engine_module
from ggml_graph_spec.server import protocol
from ggml_graph_spec.server.slot_files import SlotFiles
from tests.support.server import WAIT_S, LiveServer, LogRecords, wait_for

MARK = 4242  # the seed that marks the job a fault is injected into
GREEDY = {"prompt": "The old woman sold honey in small", "max_tokens": 6, "temperature": 0, "cache_prompt": False}


@pytest.fixture(scope="module")
def server(k3_tiny_gguf, tmp_path_factory):
    s = LiveServer(k3_tiny_gguf, "-np", 2, "-c", 2 * 256, "--slot-save-path", tmp_path_factory.mktemp("slots"))
    s.reference = s.http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    yield s
    s.close()


@pytest.fixture
def logs():
    with LogRecords() as records:
        yield records


def _serves_as_before(server, logs) -> None:
    """The engine alive, its slots free, the same greedy reply, and nothing logged but lines."""
    assert server.engine.failure is None and server.service.alive()
    wait_for(server.idle, "every slot to be free")
    assert server.engine._outstanding == 0
    assert server.http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == server.reference
    assert not server.tracebacks() and not logs.lines(), (server.tracebacks(), logs.lines())


def test_a_count_the_engine_cannot_hold_is_a_400_and_minus_one_is_the_context(server, logs):
    r = server.http.post("/v1/completions", json={**GREEDY, "repeat_last_n": 2**63})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "'repeat_last_n' must be <= 9223372036854775807 (int64), got " \
                                           "9223372036854775808"
    for n in (-1, 2**63 - 1):
        ok = server.http.post("/v1/completions", json={**GREEDY, "repeat_last_n": n, "repeat_penalty": 1.3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
    _serves_as_before(server, logs)


def _fault_in(monkeypatch, target, name: str, after: int = 0) -> None:
    """Make target.name raise for the marked job, after `after` good calls."""
    real, calls = getattr(target, name), [0]

    def faulty(self, *args, **kwargs):
        params = getattr(self, "params", None) or (args[0] if args else None)
        if getattr(params, "seed", None) == MARK:
            calls[0] += 1
            if calls[0] > after:
                raise ValueError("injected fault")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(target, name, faulty)


def _two_at_once(server, marked: dict, other: dict) -> tuple[httpx.Response, httpx.Response]:
    """The other request's first step held at the gate, the marked one submitted meanwhile: it
    starts in the next step, beside the other."""
    out: dict = {}

    def post(key, body):
        out[key] = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
    server.gate.close()
    threads = [threading.Thread(target=post, args=(k, b)) for k, b in (("other", other), ("marked", marked))]
    threads[0].start()
    wait_for(server.gate.waiting.is_set, "the other request's first step at the gate")
    threads[1].start()
    wait_for(lambda: server.engine._outstanding == 2, "the marked request submitted")
    server.gate.open()
    for t in threads:
        t.join(WAIT_S)
    return out["marked"], out["other"]


@pytest.mark.parametrize("where", ["sampling", "start"])
def test_a_fault_in_one_job_fails_it_alone_while_the_other_decodes_on(server, logs, monkeypatch, where):
    if where == "sampling":
        _fault_in(monkeypatch, sampling.Sampler, "__call__", after=2)
    else:
        _fault_in(monkeypatch, engine_module.Sampler, "__init__")
    seen = len(server.log)
    marked, other = _two_at_once(server, {**GREEDY, "seed": MARK, "max_tokens": 20}, GREEDY)
    assert marked.status_code == 500
    assert marked.json()["error"] == {"code": 500, "message": "ValueError: injected fault", "type": "server_error"}
    assert other.status_code == 200 and other.json()["choices"][0]["text"] == server.reference
    lines = [line for line in server.log[seen:] if "injected fault" in line]
    assert len(lines) == 1 and lines[0].startswith("error: task ")
    monkeypatch.undo()
    _serves_as_before(server, logs)


def test_a_fault_mid_stream_ends_that_stream_with_its_error_event(server, logs, monkeypatch):
    _fault_in(monkeypatch, sampling.Sampler, "__call__", after=3)
    body = {**GREEDY, "seed": MARK, "max_tokens": 20, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) == 4 and all("choices" in e for e in events[:3])
    assert events[-1] == {"error": {"code": 500, "message": "ValueError: injected fault", "type": "server_error"}}
    monkeypatch.undo()
    _serves_as_before(server, logs)


def test_a_fault_of_a_step_fails_its_jobs_and_the_engine_serves_on(server, logs):
    server.gate.fail_next = RuntimeError("the model's call failed")
    r = server.http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 500 and r.json()["error"]["message"] == "the model's call failed"
    _serves_as_before(server, logs)


def test_a_fault_in_a_slot_action_is_a_500_and_the_engine_serves_on(server, logs, monkeypatch):
    def broken(*_args):
        raise KeyError("a slot file's fault")
    monkeypatch.setattr(SlotFiles, "run", broken)
    r = server.http.post("/slots/0?action=save", json={"filename": "x.bin"})
    assert r.status_code == 500 and r.json()["error"]["message"] == "slot 0: save failed (KeyError)"
    monkeypatch.undo()
    _serves_as_before(server, logs)


@pytest.mark.parametrize("path, body, shape", [
    ("/v1/completions", GREEDY, "openai"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}, "anthropic"),
])
def test_a_fault_in_a_handler_is_a_500_object_and_one_line_never_a_traceback(server, logs, monkeypatch, path, body,
                                                                            shape):
    def broken(*_args, **_kwargs):
        raise RuntimeError("a handler's fault")
    monkeypatch.setattr(protocol, "completion_prompt", broken)
    monkeypatch.setattr(protocol, "chat_prompt", broken)
    r = server.http.post(path, json=body)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["message"] == "RuntimeError: a handler's fault"
    assert error["type"] == ("server_error" if shape == "openai" else "api_error")
    assert server.log[-1] == f"error: POST {path}: RuntimeError: a handler's fault"
    monkeypatch.undo()
    _serves_as_before(server, logs)
