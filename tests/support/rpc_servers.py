"""kimi-k3-rpc-server processes on loopback for the tests, and a proxy that cuts a connection.

`RpcServers(n)` starts n servers on free 127.0.0.1 ports and waits until each answers ggml's
handshake; leaving the `with` block (or `close`) kills whatever is still running. Nothing here
listens on or connects to anything but 127.0.0.1.

`Proxy` forwards one server's connections, counts the commands and bytes that go through, can
close both ends when the client sends its n-th GRAPH_COMPUTE command (a server lost in the middle
of a ggml call, deterministically), and can rewrite a command's replies (a server, or anything
in the middle, that lies).
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Callable, Mapping

from ggml_graph_spec.backends.rpc.protocol import REPLY_SIZE, reply_size
from ggml_graph_spec.backends.rpc.wire import COMMANDS, Endpoint, RpcError, handshake, recv_exactly

from .paths import REPO

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 60.0  # a server process importing ggml on a loaded 2-core machine
STOP_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def server_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "ggml_graph_spec.tools.rpc_server", *args]


def start_server(port: int, *extra: str, threads: int = 1) -> subprocess.Popen:
    return subprocess.Popen(server_command("--port", str(port), "-t", str(threads), *extra), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_ready(proc: subprocess.Popen, port: int) -> None:
    """Poll ggml's handshake until the server answers (it binds inside a blocking ggml call)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc server on port {port} exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            handshake(Endpoint(LOOPBACK, port))
            return
        except RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=STOP_TIMEOUT_S)
    if proc.stderr is not None:
        proc.stderr.close()


class RpcServers:
    """n servers on free loopback ports; endpoints as "127.0.0.1:port" strings."""

    def __init__(self, n: int, *extra: str, threads: int = 1):
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        try:
            for _ in range(n):
                port = free_port()
                proc = start_server(port, *extra, threads=threads)
                self.procs.append(proc)
                self.ports.append(port)
                wait_ready(proc, port)
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [f"{LOOPBACK}:{p}" for p in self.ports]

    def kill(self, i: int) -> None:
        """Kill server i and wait until it is gone (its sockets are closed by then)."""
        stop(self.procs[i])

    def close(self) -> None:
        for proc in self.procs:
            stop(proc)

    def __enter__(self) -> "RpcServers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Proxy:
    """A loopback TCP proxy to `target_port` that serves one connection at a time, like the
    server. It counts the client's commands (bytes with their headers, and calls, per command)
    and the bytes coming back; with `cut_at` it drops the connection on the client's cut_at-th
    GRAPH_COMPUTE (counted over all its connections), with `stall_at` it holds it open and
    silent there; `rewrite` replaces the payload of a command's reply on its way back (command ->
    function of the request and the reply)."""

    def __init__(self, target_port: int, cut_at: int | None = None,
                 rewrite: Mapping[str, Callable[[bytes, bytes], bytes]] | None = None, stall_at: int | None = None):
        self._target = (LOOPBACK, target_port)
        self._cut_at, self._stall_at = cut_at, stall_at
        self._closed = threading.Event()
        self._rewrite = dict(rewrite or {})
        self.sent: Counter[str] = Counter()  # command -> bytes from the client
        self.calls: Counter[str] = Counter()
        self.received = 0  # bytes from the server
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def computes(self) -> int:
        return self.calls["GRAPH_COMPUTE"]

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], int]:
        return dict(self.sent), dict(self.calls), self.received

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with client, socket.create_connection(self._target) as server:
                self._forward_commands(client, server)
                for s in (client, server):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # already closed by the other side

    def _forward_commands(self, client: socket.socket, server: socket.socket) -> None:
        """One command (cmd byte, u64 size, payload) at a time, then its reply if it has one."""
        try:
            while len(header := recv_exactly(client, 9)) == 9:
                name = COMMANDS[header[0]] if header[0] < len(COMMANDS) else f"unknown {header[0]}"
                size = struct.unpack("<Q", header[1:])[0]
                self.calls[name] += 1  # counted before the server can answer it
                if name == "GRAPH_COMPUTE" and self.computes == self._cut_at:
                    return
                if name == "GRAPH_COMPUTE" and self.computes == self._stall_at:
                    self._closed.wait()  # a server gone silent in the middle of a graph
                    return
                self.sent[name] += 9 + size
                request = recv_exactly(client, size)
                if len(request) < size:
                    return
                server.sendall(header + request)
                expected = reply_size(name, request) if name in REPLY_SIZE else None
                if expected is not None and not self._reply(name, request, server, client):
                    return
        except OSError:
            return

    def _reply(self, name: str, request: bytes, server: socket.socket, client: socket.socket) -> bool:
        head = recv_exactly(server, 8)
        if len(head) < 8:
            return False
        reply = recv_exactly(server, struct.unpack("<Q", head)[0])
        self.received += len(head) + len(reply)  # counted before the client can see it
        if name in self._rewrite:
            reply = self._rewrite[name](request, reply)
        client.sendall(struct.pack("<Q", len(reply)) + reply)
        return True

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


def interrupt(proc: subprocess.Popen, sig: int = signal.SIGINT) -> tuple[int, str]:
    """Send sig and wait: (exit code, stderr)."""
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=STOP_TIMEOUT_S)
    return proc.returncode, err
