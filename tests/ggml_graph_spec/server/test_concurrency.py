"""Many clients at once: 8 concurrent requests each get their solo reply (greedy, exact path) while
decoding together; a client that disconnects frees its slot at the next step; a full queue is a 503
with Retry-After; a client that never reads its stream holds up nobody.

The engine's steps are gated (tests/support/server.py): a test decides when each step runs, so
what is running together is known, not hoped for."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from tests.support.server import WAIT_S, LiveServer, wait_for

PROMPTS = ["The old woman sold", "A lighthouse", "In the morning the harbour was quiet and", "Bees",
           "She counted the jars twice before", "Rain fell on the", "Honey", "The keeper wrote in his log that the"]


@pytest.fixture(scope="module")
def server(k3_tiny_gguf):
    s = LiveServer(k3_tiny_gguf, "-np", 8, "-c", 8 * 256, "--exact-experts", "-b", 8)
    yield s
    s.close()


def _body(i: int) -> dict:
    # Different prompts and lengths; no prompt cache, so solo and concurrent runs compute the same.
    return {"prompt": PROMPTS[i], "max_tokens": 3 + i, "temperature": 0, "cache_prompt": False}


def _complete(url: str, body: dict, out: dict, key) -> None:
    out[key] = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S).json()


def _eight_at_once(server: LiveServer) -> None:
    solo = {}
    for i in range(8):
        _complete(server.url, _body(i), solo, i)
    decodes = server.engine.stats.n_decode
    server.gate.close()
    together: dict = {}
    threads = [threading.Thread(target=_complete, args=(server.url, _body(i), together, i)) for i in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: server.engine._outstanding == 8, "8 requests in the engine")
    server.gate.open()
    for t in threads:
        t.join(WAIT_S)
    for i in range(8):
        assert together[i]["choices"][0]["text"] == solo[i]["choices"][0]["text"], i
        assert together[i]["usage"]["completion_tokens"] == 3 + i
    steps = server.engine.stats.n_decode - decodes
    longest = 3 + 7 + -(-max(len(p) for p in PROMPTS) // 8)  # prompts in chunks of -b 8, then one token a step
    assert steps <= longest + 2, f"{steps} steps: the requests did not decode together"


def test_eight_clients_at_once_each_get_their_solo_reply(server):
    _eight_at_once(server)


def test_eight_clients_at_once_on_k31pro_with_dsa(k31pro_tiny_gguf):
    """The same on K3.1-Pro with its DSA indexer (top_k 8: the selection is sparse for these
    lengths), each request's selection over its own cache rows."""
    dsa = LiveServer(k31pro_tiny_gguf, "-np", 8, "-c", 8 * 256, "--exact-experts", "-b", 8,
                     "--override-kv", "kimi-k3.attention.indexer.top_k=int:8")
    try:
        _eight_at_once(dsa)
    finally:
        dsa.close()


def test_a_client_that_disconnects_frees_its_slot_at_the_next_step(server):
    server.gate.close()
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            server.gate.step(2)  # the prompt, then one token
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
            (job,) = server.engine._running.values()
    wait_for(job.cancel_requested.is_set, "the server to notice the disconnect")
    server.gate.open()
    wait_for(server.idle, "the slot to be freed")
    assert job.tokens < 200
    assert any(f"task {job.id}:" in line and line.endswith("cancelled") for line in server.log)


def test_a_client_that_never_reads_holds_up_nobody(server):
    """A streaming request whose client reads nothing: the engine runs it to its end regardless
    and serves another client meanwhile; its slot is free when its generation ends."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(server.service.sock.getsockname())
    body = json.dumps({"prompt": "Once", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                       "stream": True, "logprobs": 5}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        other = httpx.post(server.url + "/v1/completions", json={"prompt": "Bees", "max_tokens": 2}, timeout=WAIT_S)
        assert other.status_code == 200
        wait_for(server.idle, "the unread request's generation to end")
    finally:
        s.close()


def test_a_full_queue_is_503_with_retry_after(k3_tiny_gguf):
    small = LiveServer(k3_tiny_gguf, "-np", 1, "--queue", 1, "-c", 256)
    try:
        small.gate.close()
        out: dict = {}
        threads = [threading.Thread(target=_complete, args=(small.url, {"prompt": "x", "max_tokens": 2}, out, i))
                   for i in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: small.engine._outstanding == 2, "one request in the slot and one in the queue")
        r = small.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "unavailable_error" and "--queue" in r.json()["error"]["message"]
        small.gate.open()
        for t in threads:
            t.join(WAIT_S)
        assert all(out[i]["usage"]["completion_tokens"] == 2 for i in range(2))
        assert small.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        small.close()


def test_a_client_that_stops_reading_is_dropped_after_the_timeout(k3_tiny_gguf):
    """--timeout bounds each write: a stream whose client reads nothing while the socket buffers
    are full is dropped (its generation already ran to its end: the engine never waits for it)."""
    short = LiveServer(k3_tiny_gguf, "-np", 1, "-c", 512, "--timeout", 1)
    # Small kernel buffers on both ends (the accepted socket inherits the listening one's), so that
    # the unread stream fills them within its first tokens rather than after megabytes.
    short.service.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    try:
        s.connect(short.service.sock.getsockname())
        body = json.dumps({"prompt": "Once", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                           "stream": True, "logprobs": 20}).encode()  # ~2 KB an event
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: any("(--timeout): dropped" in line for line in short.log), "the stalled client to be dropped")
        assert short.http.post("/v1/completions", json={"prompt": "Bees", "max_tokens": 2}).status_code == 200
    finally:
        s.close()
        short.close()


# ---- the fast path, --mem-budget, --rpc ------------------------------------------------------------

FAST_BOUND_SHORT = 2.5  # the fast path's bound of the reference on the short prompt (test_model, test_sequences)


def _together(server: LiveServer, bodies: list[dict]) -> list[dict]:
    out: dict = {}
    threads = [threading.Thread(target=_complete, args=(server.url, b, out, i)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return [out[i] for i in range(len(bodies))]


def test_fast_path_concurrent_replies_stay_within_the_engine_bound_of_the_solo_ones(k3_tiny_gguf):
    """The fast path rounds activations after each matmul, and a single decoding column takes
    another kernel than a batch (docs/engine.md; the head's matmul too, on each request's last
    column): a concurrent reply is within the engine's bound of its solo run, not equal. While
    the tokens agree, each log-probability is within 2 x (2 x FAST_BOUND_SHORT): every logit
    within twice the bound (test_sequences), and a log-probability moves by at most twice its
    largest logit's move (the log-sum-exp moves by at most that). The first tokens agree."""
    fast = LiveServer(k3_tiny_gguf, "-np", 8, "-c", 8 * 256)
    try:
        bodies = [{**_body(i), "logprobs": 5} for i in range(8)]
        solo = [httpx.post(fast.url + "/v1/completions", json=b, timeout=WAIT_S).json() for b in bodies]
        fast.gate.close()
        threads_out = []
        runner = threading.Thread(target=lambda: threads_out.append(_together(fast, bodies)))
        runner.start()
        wait_for(lambda: fast.engine._outstanding == 8, "8 requests in the engine")
        fast.gate.open()
        runner.join(WAIT_S)
        for s, t in zip(solo, threads_out[0]):
            a, b = s["choices"][0]["logprobs"], t["choices"][0]["logprobs"]
            assert a["tokens"][0] == b["tokens"][0]
            for x, y, tx, ty in zip(a["token_logprobs"], b["token_logprobs"], a["tokens"], b["tokens"]):
                if tx != ty:
                    break
                assert abs(x - y) <= 2 * 2 * FAST_BOUND_SHORT
    finally:
        fast.close()


@pytest.mark.parametrize("placement", ["mem-budget", "rpc"])
def test_concurrent_replies_under_a_memory_budget_and_over_rpc_equal_the_local_ones(server, k3_tiny_gguf, placement):
    """--mem-budget streams the layers that do not fit from the file each step, --rpc computes
    layers on a ggml RPC server: both with the same kernels as here (exact path), so the replies
    are the local server's."""
    bodies = [_body(i) for i in range(4)]
    local = _together(server, bodies)
    if placement == "mem-budget":
        other = LiveServer(k3_tiny_gguf, "-np", 4, "-c", 4 * 256, "--exact-experts", "-b", 8,
                           "--mem-budget", 2_000_000)  # some layers pinned, the rest streamed
        rpc = None
    else:
        from tests.support.rpc_servers import RpcServers

        rpc = RpcServers(1)
        other = LiveServer(k3_tiny_gguf, "-np", 4, "-c", 4 * 256, "--exact-experts", "-b", 8,
                           "--rpc", rpc.endpoints[0], "-ts", "1,1")
    try:
        if rpc is None:
            assert other.model.executor.plan_.streamed, "the budget streams no layer: the test would prove nothing"
        else:
            assert other.model.devices is not None
        assert [r["choices"][0]["text"] for r in _together(other, bodies)] == \
            [r["choices"][0]["text"] for r in local]
    finally:
        other.close()
        if rpc is not None:
            rpc.close()


def test_slot_actions_without_a_slot_save_path_are_501(server):
    r = server.http.post("/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert "--slot-save-path" in r.json()["error"]["message"]


def test_a_step_the_model_refuses_fails_its_requests_only(server):
    from ggml_graph_spec.engine.model import EvalError

    server.gate.fail_next = EvalError("the model computed a non-finite logit")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Bees", "max_tokens": 2}, timeout=WAIT_S)
    assert r.status_code == 500 and r.json()["error"] == {
        "code": 500, "message": "the model computed a non-finite logit", "type": "server_error"}
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Bees", "max_tokens": 2}, timeout=WAIT_S)
    assert ok.status_code == 200 and server.engine.failure is None
