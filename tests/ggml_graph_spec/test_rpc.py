"""The model split over kimi-k3-rpc-server processes on loopback (ggml's RPC backend).

The servers run ggml's own CPU backend, so a layer computes there with the same kernels as
here: the fast path over RPC must give the local fast path's logits bit for bit, and the exact
path the reference's within test_model's bound (LOGITS_ATOL and its derivation). Servers are
started by the tests on free 127.0.0.1 ports and killed when the module ends.
"""
from __future__ import annotations

import re
import select
import socket
import subprocess
import sys
from collections import Counter

import ggml
import numpy as np
import pytest

from gguf_arch.arch.tensors import ATTN_NORM, OUTPUT, TOKEN_EMBD, layer_name
from ggml_graph_spec.graph.build import F32, GraphBuild, new_tensor
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.graph.placement import INPUT_SEGMENT
from ggml_graph_spec.backends.rpc.relay import tcp_traffic
from ggml_graph_spec.backends.rpc.wire import Endpoint, Connection
from ggml_graph_spec.backends.sched import SchedExecutor
from tests.support.reference import LOGITS_ATOL, N_CTX, assert_greedy_matches, assert_logits, load_reference
from tests.support.paths import REPO
from tests.support.rpc_servers import Proxy, RpcServers

THREE_WAYS = "1,1,1"  # two servers, then this host: layers 0-4, 5-8, 9-12 of the 13
HIDDEN_ATOL = LOGITS_ATOL  # the fixture README's suggestion for hidden states too (tests/support/reference.py)


@pytest.fixture(scope="module", params=["k3", "k31pro"])
def fixture(request, k3_tiny_gguf, k31pro_tiny_gguf, k3_tiny_dir, k31pro_tiny_dir):
    gguf, model_dir = {"k3": (k3_tiny_gguf, k3_tiny_dir), "k31pro": (k31pro_tiny_gguf, k31pro_tiny_dir)}[request.param]
    return gguf, load_reference(model_dir)


@pytest.fixture(scope="module")
def servers():
    with RpcServers(3) as s:
        yield s


def _load(gguf, servers, n_servers: int = 2, split: str = THREE_WAYS, **kw) -> Model:
    return Model.load(gguf, n_ctx=N_CTX, n_threads=1, rpc=servers.endpoints[:n_servers], tensor_split=split, **kw)


def _buffer_name(t) -> str:
    return ggml.ggml_backend_buffer_name(t.contents.buffer).decode()


def test_exact_path_over_two_servers_matches_the_reference(fixture, servers):
    gguf, ref = fixture
    m = _load(gguf, servers, exact_experts=True)
    try:
        for prompt in ("short", "long"):
            m.reset()
            assert_logits(m.eval(ref[f"input_ids_{prompt}"]), ref[f"logits_{prompt}"], f"logits_{prompt}")
        assert m.executor.n_splits() == 4  # embedding here, layers 0-4 and 5-8 there, 9-12 + output here
        assert_greedy_matches(m, ref)
        m.reset()
        r = m.run(ref["input_ids_short"], want=("hidden",))  # outputs read back from every device
        for layer in range(m.cfg.num_layers):
            assert np.abs(r.hidden[layer] - ref[f"hidden_after_layer_{layer}"]).max() <= HIDDEN_ATOL, layer
    finally:
        m.close()


def _where(t) -> str:
    """The server name of an RPC buffer, "here" for this host's memory."""
    return "here" if ggml.ggml_backend_buffer_is_host(t.contents.buffer) else _buffer_name(t)


def test_each_layer_keeps_its_weights_and_state_on_its_device(k31pro_tiny_gguf, servers):
    m = _load(k31pro_tiny_gguf, servers)
    try:
        # each server's device 0, as ggml names it: by the address it connects to (the server's relay)
        a, b = (f"RPC0[{c.ggml_endpoint.decode()}]" for c in m.devices.connections[:2])
        want = [a] * 5 + [b] * 4 + ["here"] * 4
        assert m.devices.placement.layer_device == (0,) * 5 + (1,) * 4 + (2,) * 4
        for l in range(m.cfg.num_layers):
            tensors = [m.weights.tensors[layer_name(ATTN_NORM, l)]]
            tensors += [m.cache.kda_state(l), m.cache.kda_conv(l, "q")] if m.cfg.is_kda(l) else \
                [m.cache.mla_latent(l), m.cache.indexer_keys(l)]
            assert [_where(t) for t in tensors] == [want[l]] * len(tensors), l
        assert _where(m.weights.tensors[TOKEN_EMBD]) == "here"
        assert _where(m.weights.tensors[OUTPUT]) == "here"
    finally:
        m.close()


@pytest.mark.parametrize("dsa, top_k, dsa_path", [
    (True, None, "gather"), (True, 8, "gather"), (True, 8, "masked"), (False, None, None)])
def test_fast_path_over_three_servers_equals_the_local_fast_path(k31pro_tiny_gguf, servers, dsa, top_k, dsa_path):
    """Everything on the servers (this host's share 0: the output head runs on the last one).
    The baseline is the local run without repack: --rpc never repacks, and repacked experts take
    other kernels, whose sums round otherwise (test_repack.py)."""
    ids = np.load(REPO / "tests/fixtures/k31pro-tiny/reference.npz")["input_ids_long"]
    kw = dict(dsa=dsa, top_k=top_k, dsa_path=dsa_path)
    local = Model.load(k31pro_tiny_gguf, n_ctx=N_CTX, n_threads=1, repack=False, **kw)
    try:
        want = np.concatenate([local.eval(ids[:90])] + [local.eval([t]) for t in ids[90:]])
    finally:
        local.close()
    m = _load(k31pro_tiny_gguf, servers, 3, "1,1,1,0", **kw)
    try:
        assert m.devices.placement.output_device == 2
        got = np.concatenate([m.eval(ids[:90])] + [m.eval([t]) for t in ids[90:]])
    finally:
        m.close()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dsa_path", ["gather", "masked"])
def test_forced_small_top_k_over_rpc_matches_the_reference(k31pro_tiny_gguf, k31pro_tiny_dir, servers, dsa_path):
    """top-k 8 < the long prompt's 96 tokens: the DSA sparse regime, on both attention paths."""
    ref = np.load(k31pro_tiny_dir / "reference.npz")
    m = _load(k31pro_tiny_gguf, servers, exact_experts=True, top_k=8, dsa_path=dsa_path)
    try:
        assert_logits(m.eval(ref["input_ids_long"]), ref["topk8__logits_long"], "topk8__logits_long")
    finally:
        m.close()


def test_split_gguf_over_rpc(tmp_path, k3_tiny_gguf, k3_tiny_dir, servers):
    from tests.support.gguf_edit import rewritten_copy  # llama.cpp-style split via gguf-py's writer

    rewritten_copy(k3_tiny_gguf, tmp_path / "split.gguf", split_max_tensors=150)
    ref = np.load(k3_tiny_dir / "reference.npz")
    m = _load(tmp_path / "split-00001-of-00003.gguf", servers, exact_experts=True)
    try:
        assert_logits(m.eval(ref["input_ids_short"]), ref["logits_short"], "logits_short")
    finally:
        m.close()


def test_a_view_among_another_devices_nodes_is_refused_before_compute(servers):
    """The scheduler starts a device's run at its first non-view node: a view of a server's
    tensor made first in a segment would be sent to the previous device's server."""
    ep = servers.endpoints[0].encode()
    rpc, cpu = ggml.ggml_backend_rpc_init(ep, 0), ggml.ggml_backend_cpu_init()
    wctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * 2, mem_buffer=None,
                                                no_alloc=True))
    weight = new_tensor(wctx, F32, (4, 2))
    buffer = ggml.ggml_backend_alloc_ctx_tensors(wctx, rpc)
    exe = SchedExecutor([rpc, cpu], 64, lambda seg: 1 if seg == INPUT_SEGMENT else 0, lambda: None)
    try:
        def make(ctx, gf):
            return GraphBuild(ctx, gf, None, _NoCache(), n_tokens=2, exact=True, top_k=None, segments=True)

        with exe.graph(64, make) as g:
            x = ggml.ggml_scale(g.ctx, g.input("x", F32, (4, 2), np.ones((2, 4))), 2.0)  # on the CPU
            g.begin_segment(0)
            rows = ggml.ggml_view_2d(g.ctx, weight, 4, 2, weight.contents.nb[1], 0)  # the segment's first op
            with pytest.raises(RuntimeError, match="sits among another device's nodes"):
                exe.compute(g, [ggml.ggml_add(g.ctx, rows, x)])
    finally:
        exe.free()
        ggml.ggml_backend_buffer_free(buffer)
        ggml.ggml_free(wctx)
        ggml.ggml_backend_free(rpc)


class _NoCache:
    n_past = 0


def test_connection_watch_sees_a_closed_socket(servers):
    """Connection.alive reads the state of the relay's connection to the server only: a live idle
    connection is alive, and the same connection after the server went away is not."""
    with RpcServers(1) as one:
        c = Connection(Endpoint("127.0.0.1", one.ports[0]), "127.0.0.1")
        rpc = ggml.ggml_backend_rpc_init(c.ggml_endpoint, 0)
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead(), mem_buffer=None,
                                                   no_alloc=True))
        new_tensor(ctx, F32, (8,))
        buffer = ggml.ggml_backend_alloc_ctx_tensors(ctx, rpc)  # holds ggml's connection open
        c.attach()
        assert c.alive()
        sent, received = c.traffic()
        assert sent > 0 and received > 0
        one.kill(0)
        assert not c.alive()
        # The buffer of a lost server is left (freeing it is a command ggml would abort on).
        del buffer
        ggml.ggml_free(ctx)


def _driver(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)


# What ggml and Python print when they fail on their own: ggml's abort report (file:line, then a
# backtrace), its transport's log lines, a traceback.
_RAW_FAILURE = re.compile(r"\.(c|cpp|h):\d+: |^#\d+ |send failed|recv failed|Failed to connect|Traceback")


def _one_error_line(err: str, *needles: str) -> str:
    """stderr ends with exactly one error line, and nothing before it is a raw failure report
    (the runner's own log lines, print_info: and the like, may come first)."""
    lines = err.rstrip("\n").splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert not any(_RAW_FAILURE.search(line) for line in lines[:-1]), err
    for needle in needles:
        assert needle in errors[0], err
    return errors[0]


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line of the child's stdout, or "" if none came within timeout seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def test_a_server_killed_between_calls_is_an_error_naming_it(k31pro_tiny_gguf):
    """The model raises RpcError at its next call; closing it afterwards does not abort."""
    with RpcServers(2) as two:
        code = f"""
import sys
from gguf_arch.errors import run_cli
from ggml_graph_spec.engine.model import Model

def body():
    m = Model.load({str(k31pro_tiny_gguf)!r}, n_ctx=32, n_threads=1, rpc={two.endpoints!r}, tensor_split="1,1,1")
    try:
        m.eval([656, 1, 2])
        print("ready", flush=True)
        sys.stdin.readline()  # the test kills server 1 meanwhile
        m.eval([3])
    finally:
        m.close()

sys.exit(run_cli(body))
"""
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert _readline(proc, timeout=120) == "ready\n", proc.stderr.read() if proc.poll() is not None else ""
            two.kill(1)
            out, err = proc.communicate("go\n", timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 1, err
    _one_error_line(err, f"RPC server {two.endpoints[1]}: connection lost before a graph")


def test_a_server_lost_during_a_graph_ends_the_cli_with_one_line(k31pro_tiny_gguf):
    """The proxy drops server 0's connection on its second graph (the first after the warm-up):
    ggml's client fails inside the scheduler's compute, and the abort guard reports it."""
    with RpcServers(2) as two:
        proxy = Proxy(two.ports[0], cut_at=2)
        try:
            r = _driver(f"""
import sys
from ggml_graph_spec.runner.cli import main
sys.exit(main(["-m", {str(k31pro_tiny_gguf)!r}, "--rpc", "{proxy.endpoint},{two.endpoints[1]}", "-ts", "1,1,1",
               "-p", "[BOS]The old woman", "-n", "4", "--temp", "0", "-c", "32", "-t", "1"]))
""")
        finally:
            proxy.close()
    assert r.returncode == 1, r.stderr
    _one_error_line(r.stderr, f"RPC server {proxy.endpoint}: connection lost during a ggml call")
    assert proxy.computes == 2


@pytest.mark.parametrize("rpc, code, message", [
    ("nonsense", 2, "--rpc 'nonsense': expected HOST:PORT"),
    ("127.0.0.1:99999", 2, "expected HOST:PORT"),
    ("127.0.0.1:50052,127.0.0.1:50052", 2, "is given twice"),
])
def test_a_malformed_endpoint_is_bad_input(capsys, k3_tiny_gguf, rpc, code, message):
    from ggml_graph_spec.runner.cli import main

    rc = main(["-m", str(k3_tiny_gguf), "--rpc", rpc, "-p", "x", "-n", "1", "-c", "16"])
    err = capsys.readouterr().err
    assert rc == code and message in _one_error_line(err), err


def test_an_unreachable_server_at_load_is_one_line_and_exit_1(capsys, k3_tiny_gguf):
    from ggml_graph_spec.runner.cli import main
    from tests.support.rpc_servers import free_port

    port = free_port()  # nothing listens there
    rc = main(["-m", str(k3_tiny_gguf), "--rpc", f"127.0.0.1:{port}", "-p", "x", "-n", "1", "-c", "16"])
    err = capsys.readouterr().err
    assert rc == 1
    _one_error_line(err, f"RPC server 127.0.0.1:{port}: cannot connect: connection refused")


def test_cli_over_rpc_streams_the_reference_text_and_says_where_layers_went(capsys, k3_tiny_gguf, k3_tiny_dir,
                                                                          servers):
    from ggml_graph_spec.runner.cli import main
    from ggml_graph_spec.text.tokenizer import BPETokenizer

    ref = np.load(k3_tiny_dir / "reference.npz")
    prompt = "[BOS]The old woman sold honey in small"
    rc = main(["-m", str(k3_tiny_gguf), "-p", prompt, "-n", "16", "--temp", "0", "-c", "64", "-t", "1",
               "--exact-experts", "--rpc", ",".join(servers.endpoints[:2]), "--tensor-split", THREE_WAYS])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out[len(prompt):-1] == BPETokenizer.from_gguf(k3_tiny_gguf).decode([int(i) for i in ref["greedy_ids"]])
    a, b = servers.endpoints[:2]
    for line in (f"print_info: device 0         = RPC0[{a}]: layers 0-4; ",
                 f"print_info: device 1         = RPC1[{b}]: layers 5-8; ",
                 "print_info: device 2         = CPU: this host; layers 9-12; embedding; output; "):
        assert line in err, err


def test_perplexity_over_rpc_equals_the_local_one(capsys, tmp_path, k31pro_tiny_gguf, k31pro_tiny_dir, servers):
    from ggml_graph_spec.runner.cli import main

    text = tmp_path / "text.txt"
    text.write_text(str(np.load(k31pro_tiny_dir / "reference.npz")["prompt_long_text"]).replace("[BOS]", ""))
    base = ["-m", str(k31pro_tiny_gguf), "--perplexity", "-f", str(text), "-c", "32", "--chunks", "2", "-t", "1"]
    assert main(base) == 0
    local = capsys.readouterr().out
    assert main(base + ["--rpc", ",".join(servers.endpoints), "-ts", "1,2,1,1"]) == 0
    assert capsys.readouterr().out == local


def test_a_reconnecting_client_is_not_sent_cached_weights_again(tmp_path, big_hidden_gguf):
    """Pieces above ggml's 10 MiB hash threshold (here output.weight, 11.2 MB) are kept by a
    server started with --cache; a second client loading the same GGUF sends their hashes only."""
    with RpcServers(1, "--cache", str(tmp_path / "cache")) as one:
        sent = []
        for _ in range(2):
            m = Model.load(big_hidden_gguf, n_ctx=16, n_threads=1, rpc=one.endpoints, tensor_split="1,0")
            try:
                sent.append(m.devices.traffic()[one.endpoints[0]][0])
                big = ggml.ggml_nbytes(m.weights.tensors[OUTPUT])
            finally:
                m.close()
    assert big > 10 << 20 and sent[0] > big
    assert sent[1] < sent[0] - big, sent
    assert len(list((tmp_path / "cache").iterdir())) >= 1


@pytest.fixture(scope="module")
def big_hidden_gguf(tmp_path_factory):
    """A synthetic K3.1-Pro GGUF whose output head exceeds ggml's RPC hash threshold (hidden 6144)."""
    from gguf_arch.convert.run import convert
    from gguf_arch.synth.cli import main as synth

    d = tmp_path_factory.mktemp("bighidden")
    assert synth([str(d / "ckpt"), "--preset", "tiny", "--hidden", "6144", "--layers", "4"]) == 0
    convert(d / "ckpt", d / "big.gguf", log=lambda _msg: None)
    return d / "big.gguf"


def test_tcp_info_offsets_are_the_kernels(servers):
    """traffic() reads tcpi_bytes_acked / tcpi_bytes_received at fixed offsets of struct
    tcp_info: a connection that sent and received known amounts reports them."""
    ep = Endpoint("127.0.0.1", servers.ports[2])
    with socket.create_connection(("127.0.0.1", ep.port)) as s:
        s.sendall(bytes([14]) + (24).to_bytes(8, "little") + bytes(24))
        reply = b""
        while len(reply) < 36:
            reply += s.recv(36 - len(reply))
        sent, received = tcp_traffic(s)
    # Linux counts the acknowledgement of the SYN in tcpi_bytes_acked: one more than the payload.
    assert (sent, received) == (33 + 1, 36)


def test_without_tensor_split_the_devices_memory_sets_the_shares(servers, k3_tiny_gguf):
    """ggml's CPU device reports the host's physical memory: two servers on this host and this
    host weigh the same, so the 13 layers go 5, 4, 4 (llama.cpp's rule on thirds)."""
    m = Model.load(k3_tiny_gguf, n_ctx=16, n_threads=1, rpc=servers.endpoints[:2])
    try:
        assert [len(m.devices.placement.layers_on(d)) for d in range(3)] == [5, 4, 4]
    finally:
        m.close()



def test_a_cpu_servers_allocation_size_is_ggml_nbytes(servers):
    """SizedHere's premise: asked over RPC (GET_ALLOC_SIZE), a kimi-k3-rpc-server sizes a
    MUL_MAT_ID and a FLASH_ATTN_EXT node at ggml_nbytes, as its CPU buffer type does."""
    rpc = ggml.ggml_backend_rpc_init(servers.endpoints[2].encode(), 0)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * 16, mem_buffer=None,
                                               no_alloc=True))
    try:
        experts = new_tensor(ctx, ggml.GGML_TYPE_MXFP4, (64, 48, 8))
        ids = new_tensor(ctx, ggml.GGML_TYPE_I32, (2, 3))
        q, kv = new_tensor(ctx, F32, (24, 3, 4)), new_tensor(ctx, ggml.GGML_TYPE_F16, (24, 32))
        nodes = [ggml.ggml_mul_mat_id(ctx, experts, new_tensor(ctx, F32, (64, 1, 3)), ids),
                 ggml.ggml_flash_attn_ext(ctx, q, kv, kv, None, 0.2, 0.0, 0.0)]
        buft = ggml.ggml_backend_get_default_buffer_type(rpc)
        assert [ggml.ggml_backend_buft_get_alloc_size(buft, n) for n in nodes] == [ggml.ggml_nbytes(n) for n in nodes]
    finally:
        ggml.ggml_free(ctx)
        ggml.ggml_backend_free(rpc)


def test_decoding_asks_no_allocation_sizes_and_reads_back_only_boundaries(k31pro_tiny_gguf, servers):
    """Per decoded token each server gets one graph, its inputs, and the client reads back
    what crosses to the next device: no GET_ALLOC_SIZE round trips, no weight transfers."""
    proxies = [Proxy(p) for p in servers.ports[:2]]
    try:
        m = Model.load(k31pro_tiny_gguf, n_ctx=N_CTX, n_threads=1, rpc=[p.endpoint for p in proxies],
                       tensor_split=THREE_WAYS)
        try:
            m.eval([656, 1, 2, 3])
            before = [Counter(p.calls) for p in proxies]
            for t in range(4):
                m.eval([t + 5])
            calls = [Counter(p.calls) - b for p, b in zip(proxies, before)]
        finally:
            m.close()
    finally:
        for p in proxies:
            p.close()
    for c in calls:
        assert set(c) <= {"GRAPH_COMPUTE", "SET_TENSOR", "GET_TENSOR"}, c
        assert c["GRAPH_COMPUTE"] == 4


def test_ggml_failing_to_connect_after_the_handshake_is_one_line(k3_tiny_gguf):
    """A server that disappears between the handshake and ggml's own connect: ggml reaches its
    relay, the relay cannot reach the server and says so (ggml would have aborted in
    ggml_backend_rpc_init). The handshake is skipped here (a stand-in returns the address) so
    that nothing listens when ggml connects."""
    from tests.support.rpc_servers import free_port

    port = free_port()
    r = _driver(f"""
import sys
from gguf_arch.errors import run_cli
from ggml_graph_spec.backends.rpc import devices
from ggml_graph_spec.engine.model import Model

devices.handshake = lambda ep, timeout: "127.0.0.1"
sys.exit(run_cli(lambda: Model.load({str(k3_tiny_gguf)!r}, n_ctx=16, n_threads=1, rpc=["127.0.0.1:{port}"],
                                    tensor_split="1,1").close()))
""")
    assert r.returncode == 1, r.stderr
    _one_error_line(r.stderr, f"RPC server 127.0.0.1:{port}: cannot connect: connection refused")
