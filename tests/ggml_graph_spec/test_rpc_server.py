"""kimi-k3-rpc-server: loopback by default, one-line errors, Ctrl-C and SIGTERM end it.

Only 127.0.0.1 is ever listened on or connected to. The non-loopback cases stop before any
socket is opened (refused without --allow-remote) or at bind time on a documentation address
(192.0.2.1, TEST-NET-1: never an address of this host).
"""
from __future__ import annotations

import signal
import socket

import pytest

from gguf_arch.errors import EXIT_BAD_INPUT, EXIT_RUNTIME
from ggml_graph_spec.backends.rpc.wire import Endpoint, handshake
from ggml_graph_spec.tools.rpc_server import UNAUTHENTICATED, main
from tests.support.rpc_servers import free_port, interrupt, start_server, wait_ready


def _run(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_listens_on_loopback_by_default_and_a_signal_ends_it(sig):
    port = free_port()
    proc = start_server(port)
    try:
        wait_ready(proc, port)
        assert handshake(Endpoint("127.0.0.1", port)) == "127.0.0.1"
    finally:
        rc, err = interrupt(proc, sig)
    assert rc == 128 + sig  # 130 for Ctrl-C, 143 for SIGTERM, as every tool (README's exit codes)
    assert err.splitlines() == [f"kimi-k3-rpc-server: ggml RPC server on 127.0.0.1:{port}, CPU, 1 thread(s), cache off",
                                f"error: interrupted ({signal.Signals(sig).name}); RPC server stopped"]


def test_a_non_loopback_host_is_refused_without_allow_remote(capsys):
    rc, err = _run(capsys, "--host", "192.0.2.1")
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1
    assert "--host 192.0.2.1 is not a loopback address" in err and "unauthenticated" in err
    assert "--allow-remote" in err


def test_allow_remote_warns_that_the_protocol_is_unauthenticated(capsys):
    # 192.0.2.1 is no address of this host: the warning comes, then binding fails (exit 1).
    rc, err = _run(capsys, "--host", "192.0.2.1", "--allow-remote", "--port", free_port())
    assert rc == EXIT_RUNTIME
    assert err.splitlines()[0] == f"warning: {UNAUTHENTICATED}"
    assert err.splitlines()[1].startswith("error: 192.0.2.1:") and "not an address of this host" in err
    assert "trusted network" in UNAUTHENTICATED


@pytest.mark.parametrize("argv, message", [
    (["--host", "localhost"], "expected an IPv4 address"),
    (["--host", "::1"], "expected an IPv4 address"),
    (["--port", "0"], "--port 0: expected 1..65535"),
    (["--port", "70000"], "--port 70000: expected 1..65535"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--port", "x"], "invalid int value"),
])
def test_bad_options_are_one_line_and_exit_2(capsys, argv, message):
    rc, err = _run(capsys, *argv)
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_a_port_in_use_is_one_line_and_exit_1(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        rc, err = _run(capsys, "--port", port)
    assert rc == EXIT_RUNTIME and err == f"error: 127.0.0.1:{port}: cannot listen: the address is already in use " \
                                         "(another server on this port?)\n"


def test_a_cache_path_that_is_a_file_is_refused(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, err = _run(capsys, "--cache", f, "--port", free_port())
    assert rc == EXIT_BAD_INPUT and f"--cache {f}: cannot create the directory" in err
