"""Servers that lie, break the protocol or go silent (classes 1, 2 and 10 of the third round):
every number a server sends is checked before ggml's client uses it, every wait on a server is
bounded, and a stop signal ends a client stuck in a ggml call on a socket.

The client is kimi-k3-cli in a child process, against a fake server (tests/support/rpc_fakes.py)
or a real kimi-k3-rpc-server behind a proxy that rewrites one reply (tests/support/rpc_servers.py).
Where a check that failed would make the client allocate without end (a device count of
2^32-1), the child runs in a memory-limited cgroup (tests/support/memlimit.py).
"""
from __future__ import annotations

import signal
import struct
import subprocess
import sys
import time

import pytest

from tests.support.cli import Result, tool_code
from tests.support.memlimit import memory_limited
from tests.support.paths import REPO
from tests.support.rpc_fakes import GIB, FakeServer
from tests.support.rpc_servers import Proxy, RpcServers

LIMIT = 3 * GIB  # the client needs ~0.4 GB; without the device-count check it took the machine's
RAW = ("Traceback", "GGML_ASSERT", "Exception ignored", "Remote RPC server crashed", "recv failed")


def _cli(gguf, endpoint: str, *extra: str, preexec=None, timeout: float = 120) -> Result:
    args = ["-m", str(gguf), "--rpc", endpoint, "-ts", "1,0", "-p", "hi", "-n", "1", "-c", "32", "-t", "1", *extra]
    res = subprocess.run([sys.executable, "-c", tool_code("cli"), *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout, preexec_fn=preexec, stdin=subprocess.DEVNULL)
    return Result(res.returncode, res.stdout, res.stderr)


def _one_line(res: Result, code: int, *needles: str) -> str:
    """Exactly one error line, the last one, and no raw report from ggml or Python before it."""
    lines = res.err.rstrip("\n").splitlines()
    assert res.rc == code, res.err
    assert [l for l in lines if l.startswith("error: ")] == lines[-1:], res.err
    assert not any(raw in res.err for raw in RAW), res.err
    for needle in needles:
        assert needle in lines[-1], res.err
    return lines[-1]


@pytest.mark.parametrize("replies, needle", [
    ({"DEVICE_COUNT": struct.pack("<I", 2**32 - 1)}, "reports 4294967295 devices"),
    ({"DEVICE_COUNT": struct.pack("<I", 17)}, "reports 17 devices"),
    ({"GET_DEVICE_MEMORY": struct.pack("<QQ", 2 * GIB, GIB)}, "reports 2147483648 bytes free of 1073741824"),
    ({"GET_DEVICE_MEMORY": struct.pack("<QQ", 0, 0)}, "reports 0 bytes free of 0"),
    ({"GET_ALIGNMENT": struct.pack("<Q", 3)}, "reports an alignment of 3"),
    ({"GET_ALIGNMENT": struct.pack("<Q", 1 << 40)}, "reports an alignment of 1099511627776"),
    ({"GET_ALIGNMENT": struct.pack("<I", 64)}, "answered GET_ALIGNMENT with 4 bytes, 8 expected"),
    ({"GET_MAX_SIZE": struct.pack("<Q", 0)}, "reports a largest buffer of 0 bytes"),
    ({"BUFFER_GET_BASE": struct.pack("<Q", 0)}, "the base address 0x0"),
    ({"BUFFER_GET_BASE": struct.pack("<Q", 0x7F0000000003)}, "the base address 0x7f0000000003"),
    ({"ALLOC_BUFFER": struct.pack("<QQ", 0x10000, 16)}, "the size 16"),
    ({"ALLOC_BUFFER": struct.pack("<QQ", 0x10000, 1 << 62)}, "the size 4611686018427387904"),
    ({"HELLO": bytes([4, 0, 1, 0]) + bytes(20)}, "answered HELLO with 24 bytes, 28 expected"),
    ({"HELLO": bytes([5, 0, 0, 0]) + bytes(24)}, "speaks ggml RPC 5.0.0"),
], ids=["devices-2^32-1", "devices-17", "free-above-total", "no-memory", "alignment-3", "alignment-2^40",
        "short-reply", "max-size-0", "base-null", "base-unaligned", "buffer-too-small", "buffer-past-memory",
        "short-hello", "other-version"])
def test_a_number_a_server_sends_is_checked_before_ggml_uses_it(k3_tiny_gguf, replies, needle):
    """The fake answers the client's handshake (a connection of its own) honestly and lies on
    ggml's connection: a check on another connection than ggml's would pass it."""
    with FakeServer(replies, honest_connections=1) as fake, memory_limited(LIMIT) as preexec:
        res = _cli(k3_tiny_gguf, fake.endpoint, preexec=preexec)
    _one_line(res, 1, f"RPC server {fake.endpoint}: ", needle, "refused before ggml used it"
              if "answered" not in needle else "")


def test_a_server_with_no_devices_is_named_as_such_not_as_a_lost_connection(k3_tiny_gguf):
    """ggml's client took a device count of 0 for a failed connection and then asserted (reg)."""
    with FakeServer({"DEVICE_COUNT": struct.pack("<I", 0)}) as fake:
        line = _one_line(_cli(k3_tiny_gguf, fake.endpoint), 1, "reports 0 devices")
    assert "connection lost" not in line


@pytest.mark.parametrize("command, rewrite, needle", [
    ("GET_ALIGNMENT", lambda req, rep: struct.pack("<Q", 3), "reports an alignment of 3"),
    ("DEVICE_COUNT", lambda req, rep: struct.pack("<I", 2**32 - 1), "reports 4294967295 devices"),
    ("ALLOC_BUFFER", lambda req, rep: rep[:8] + struct.pack("<Q", struct.unpack_from("<Q", req, 4)[0] - 1),
     "bytes the size"),
    ("GET_DEVICE_MEMORY", lambda req, rep: rep[:8] + struct.pack("<Q", 0), "bytes free of 0"),
], ids=["alignment", "device-count", "short-buffer", "no-total"])
def test_a_proxy_rewriting_a_real_servers_reply_is_caught(k3_tiny_gguf, command, rewrite, needle):
    """A real kimi-k3-rpc-server answers honestly; something in the middle changes one reply on
    ggml's own connection (a check on another connection would not see it)."""
    with RpcServers(1) as one, memory_limited(LIMIT) as preexec:
        proxy = Proxy(one.ports[0], rewrite={command: rewrite})
        try:
            res = _cli(k3_tiny_gguf, proxy.endpoint, preexec=preexec)
        finally:
            proxy.close()
    _one_line(res, 1, f"RPC server {proxy.endpoint}: ", needle)


def test_an_honest_proxy_changes_nothing(k3_tiny_gguf):
    """The same path with nothing rewritten: the run completes (the checks pass real replies)."""
    with RpcServers(1) as one:
        proxy = Proxy(one.ports[0])
        try:
            res = _cli(k3_tiny_gguf, proxy.endpoint, "--temp", "0")
        finally:
            proxy.close()
    assert res.rc == 0, res.err
    assert proxy.calls["GET_DEVICE_MEMORY"] >= 1 and proxy.calls["ALLOC_BUFFER"] >= 1


@pytest.mark.parametrize("silent_from", ["GET_DEVICE_MEMORY", "ALLOC_BUFFER", "GET_TENSOR"])
def test_a_server_that_goes_silent_is_a_bounded_wait(k3_tiny_gguf, silent_from):
    """It answers the handshake, then nothing: the wait ends at --rpc-timeout with one line. The
    server never answers, so the outcome does not depend on how long the machine takes."""
    with FakeServer(silent_from=silent_from) as fake:
        res = _cli(k3_tiny_gguf, fake.endpoint, "--rpc-timeout", "0.5")
    _one_line(res, 1, f"RPC server {fake.endpoint}: sent no reply within 0.5 s ({silent_from}; --rpc-timeout)")


def test_a_server_silent_at_the_handshake_is_bounded_by_the_timeout_too(k3_tiny_gguf):
    with FakeServer(silent_from="HELLO") as fake:
        res = _cli(k3_tiny_gguf, fake.endpoint, "--rpc-timeout", "0.4")
    _one_line(res, 1, "no answer to the handshake within 0.4 s")


def _wait_for(cond, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("silent_from", ["GET_DEVICE_MEMORY", "GET_TENSOR"])
def test_a_stop_signal_ends_a_client_stuck_in_a_ggml_call_on_a_socket(k3_tiny_gguf, sig, silent_from):
    """The client waits inside ggml (a reply that never comes, the timeout far away): SIGINT and
    SIGTERM end it at once with 130 and 143 and the interrupted line; neither is ignored, nor
    taken for a lost connection, nor reported from a ctypes callback."""
    args = ["-m", str(k3_tiny_gguf), "--rpc", "", "-ts", "1,0", "-p", "hi", "-n", "1", "-c", "32", "-t", "1"]
    with FakeServer(silent_from=silent_from) as fake:
        args[3] = fake.endpoint
        proc = subprocess.Popen([sys.executable, "-c", tool_code("cli"), *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            _wait_for(lambda: silent_from in fake.commands, f"the client's {silent_from}")
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    line = _one_line(Result(proc.returncode, out, err), 128 + sig, f"error: interrupted ({signal.Signals(sig).name})")
    assert "connection lost" not in line


def test_one_ctrl_c_ends_a_generation_stuck_on_a_silent_server(k3_tiny_gguf):
    """During generation the first Ctrl-C waits for the token under way (signals.GRACE_S); a
    server that went silent in the middle of a graph does not make it wait for --rpc-timeout."""
    with RpcServers(1) as one:
        proxy = Proxy(one.ports[0], stall_at=6)  # the warm-up and the prompt, then a few tokens
        args = ["-m", str(k3_tiny_gguf), "--rpc", proxy.endpoint, "-ts", "1,0", "-p", "hi", "-n", "1000",
                "--ignore-eos", "-c", "2048", "-t", "1"]
        proc = subprocess.Popen([sys.executable, "-c", tool_code("cli"), *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            _wait_for(lambda: proxy.computes >= 6, "the stalled graph")
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=120)
        finally:
            proxy.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    _one_line(Result(proc.returncode, out, err), 130, "error: interrupted (SIGINT)")
    assert "kimi_k3_perf: " in err  # the timings, as after any Ctrl-C during generation
