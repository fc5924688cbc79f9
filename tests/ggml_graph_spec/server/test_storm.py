"""A bounded load test with random disconnects: 40 clients at once on 4 slots, over the four
APIs, streamed and whole, each of which (seeded: which one, and when) reads its reply to the end,
goes away after its k-th event, goes away before reading anything, or goes away in the middle of
its own body. Then: no traceback and no error line in the server's log nor in uvicorn's and
asyncio's logging, every slot free and every queue empty, every connection closed, and the next
request's greedy reply equal to the same request's before the storm.

When a client goes is counted in events, not in seconds: the storm is the same on any machine.
KIMI_STORM_SEED picks another storm."""
from __future__ import annotations

import json
import os
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.server import WAIT_S, LiveServer, LogRecords, wait_for

SEED = int(os.environ.get("KIMI_STORM_SEED", "20261207"))
CLIENTS = 40
GREEDY = {"prompt": "The keeper wrote in his log that the", "max_tokens": 8, "temperature": 0, "cache_prompt": False}
USER = [{"role": "user", "content": "Name a bird."}]
APIS = {  # path, body, whether a whole reply is well formed, the last event of a stream
    "completions": ("/v1/completions", {"prompt": "Once upon a time"}, "[DONE]"),
    "chat": ("/v1/chat/completions", {"messages": USER}, "[DONE]"),
    "responses": ("/v1/responses", {"input": "Name a bird."}, "response.completed"),
    "messages": ("/v1/messages", {"messages": USER}, "message_stop"),
}
PLANS = ("read", "read", "after", "after", "after", "unread", "mid-body")


@pytest.fixture(scope="module")
def server(k3_tiny_gguf):
    s = LiveServer(k3_tiny_gguf, "-np", 4, "--queue", CLIENTS, "-c", 4 * 320)
    yield s
    s.close()


def _client(rng: random.Random) -> dict:
    api = rng.choice(sorted(APIS))
    path, body, last = APIS[api]
    n = rng.randint(1, 6)
    length = {"max_output_tokens": n} if api == "responses" else {"max_tokens": n}
    body = {**body, **length, "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1000),
            "stream": rng.random() < 0.7}
    return {"api": api, "path": path, "body": body, "last": last, "plan": rng.choice(PLANS), "k": rng.randint(0, 4)}


def _raw(server, c: dict, cut: bool) -> str:
    """Send the request on a socket and go away: mid-body (cut) or right after sending it."""
    body = json.dumps(c["body"]).encode()
    head = (f"POST {c['path']} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(server.service.sock.getsockname()[:2], timeout=WAIT_S) as s:
        s.sendall(head + (body[:len(body) // 2] if cut else body))
    return c["plan"]


def _events(r: httpx.Response):
    for line in r.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def _run(server, c: dict) -> str:
    if c["plan"] in ("unread", "mid-body"):
        return _raw(server, c, c["plan"] == "mid-body")
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        if not c["body"]["stream"]:
            r = http.post(c["path"], json=c["body"])
            assert r.status_code == 200, r.text
            return "whole"
        with http.stream("POST", c["path"], json=c["body"]) as r:
            assert r.status_code == 200
            seen = []
            for data in _events(r):
                seen.append(data)
                if c["plan"] == "after" and len(seen) > c["k"]:
                    return "gone"  # leaving the block closes the connection mid-stream
    last = seen[-1] if c["last"] == "[DONE]" else json.loads(seen[-1])["type"]
    assert last == c["last"], seen[-3:]
    return "read"


def test_a_storm_of_clients_that_go_away_leaves_the_server_as_it_was(server):
    before = server.http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    rng = random.Random(SEED)
    clients = [_client(rng) for _ in range(CLIENTS)]
    lines = len(server.log)
    with LogRecords() as logs, ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda c: _run(server, c), clients))
        wait_for(lambda: server.idle() and server.engine._outstanding == 0, "every job ended")
        state = server.service._uvicorn.server_state
        wait_for(lambda: not state.connections and not state.tasks and server.service._uvicorn.config.app.active == 0,
                 "every connection closed")
    assert {"read", "gone", "unread", "mid-body"} <= set(outcomes), outcomes
    assert not logs.tracebacks() and not logs.lines(), logs.lines()
    storm_log = server.log[lines:]
    assert not server.tracebacks() and not [line for line in storm_log if line.startswith("error")], storm_log
    assert any(line.endswith("cancelled") for line in storm_log), "no client went away mid-generation"
    assert all(not s["is_processing"] for s in server.slots()) and server.engine.deferred == 0
    assert server.http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == before
