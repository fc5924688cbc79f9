"""kimi-k3-rpc-server: ggml's own RPC server for this project's ggml, one per host.

`kimi-k3-cli --rpc HOST:PORT,...` (and `Model.load(rpc=[...])`) place layers on these servers.
The protocol is ggml's (the version of the ggml this package runs on, RPC 4.0.x for ggml
0.15.3); llama.cpp's own `rpc-server` speaks another version and cannot serve this client.

ggml's server call blocks for the life of the server, serving one client at a time. It runs in
a daemon thread so that the main thread stays in Python and handles Ctrl-C and SIGTERM: the
process then ends with os._exit, since the C thread cannot be joined and interpreter teardown
must not run under it.
"""
from __future__ import annotations

from gguf_arch.errors.signals import install

install("RPC server stopped")  # first: a stop signal during the imports below is the documented line and code

import argparse
import ctypes
import errno
import ipaddress
import os
import socket
import sys
import threading
from pathlib import Path
from typing import NoReturn, Sequence

import ggml

from gguf_arch.errors import EXIT_RUNTIME, Interrupted, KimiError, interrupted_line, run_cli
from gguf_arch.io.console import ArgumentParser, cpu_count


DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052

UNAUTHENTICATED = ("ggml's RPC protocol is unauthenticated and unencrypted: anyone who can reach this port can run "
                   "graphs and read or write this host's memory through it; use it only on a trusted network")


class ServerError(KimiError):
    """A server option is malformed or not allowed (exit code 2)."""


class StartError(KimiError):
    """The server cannot start on this host: the address cannot be listened on, or this ggml
    has no RPC backend (exit code 1)."""

    exit_code = EXIT_RUNTIME


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-rpc-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"IPv4 address to listen on (default {DEFAULT_HOST}; others need --allow-remote)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for the graphs (default: all cores)")
    p.add_argument("-c", "--cache", type=Path, default=None,
                   help="directory where the server keeps the tensors it received (>10 MiB each, by content "
                        "hash), so that a client reconnecting with the same weights does not send them again")
    p.add_argument("--allow-remote", action="store_true",
                   help="listen on a non-loopback address (the protocol is unauthenticated: trusted networks only)")
    return p


def check_host(host: str, allow_remote: bool) -> ipaddress.IPv4Address:
    """The address to bind: an IPv4 literal (ggml's server binds with inet_addr), loopback unless
    allow_remote."""
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        raise ServerError(f"--host {host!r}: expected an IPv4 address such as {DEFAULT_HOST} "
                          "(ggml's RPC server binds IPv4 addresses only, not host names)") from None
    if not ip.is_loopback and not allow_remote:
        raise ServerError(f"--host {host} is not a loopback address; {UNAUTHENTICATED}. "
                          "Pass --allow-remote to listen there anyway")
    return ip


def check_port_free(host: str, port: int) -> None:
    """Bind the address once ourselves: ggml reports a failed bind only as "Failed to create
    server socket". SO_REUSEADDR as ggml sets it, so a port in TIME_WAIT is not refused here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as exc:
            why = {errno.EADDRINUSE: "the address is already in use (another server on this port?)",
                   errno.EADDRNOTAVAIL: "not an address of this host",
                   errno.EACCES: "permission denied (ports below 1024 need root)"}.get(exc.errno, exc.strerror)
            raise StartError(f"{host}:{port}: cannot listen: {why}") from None


def _cache_dir(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ServerError(f"--cache {path}: cannot create the directory ({exc.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ServerError(f"--cache {path}: the directory is not writable")
    return str(path.resolve()).encode()


def _cpu_device():
    if not ggml.GGML_USE_RPC:
        raise StartError("this ggml-python was built without RPC (rebuild it with CMAKE_ARGS=-DGGML_RPC=ON; "
                         "see the README's setup)")
    dev = ggml.ggml_backend_dev_by_type(ggml.GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise StartError("ggml has no CPU device")
    return dev


def _serve(endpoint: bytes, cache: bytes | None, n_threads: int, device, done: threading.Event) -> None:
    devices = (ggml.ggml_backend_dev_t_ctypes * 1)(device)
    try:
        ggml.ggml_backend_rpc_start_server(endpoint, cache, n_threads, 1, devices)
    finally:
        done.set()  # ggml returns only when it could not start (or accept) at all



def run(args: argparse.Namespace) -> NoReturn:
    ip = check_host(args.host, args.allow_remote)
    if not ip.is_loopback:
        print(f"warning: {UNAUTHENTICATED}", file=sys.stderr)
    n_threads = args.threads if args.threads is not None else cpu_count()
    if n_threads < 1:
        raise ServerError(f"--threads must be >= 1, got {n_threads}")
    if not 1 <= args.port <= 65535:
        raise ServerError(f"--port {args.port}: expected 1..65535")
    cache = _cache_dir(args.cache)
    device = _cpu_device()
    check_port_free(str(ip), args.port)
    endpoint = f"{ip}:{args.port}"
    print(f"kimi-k3-rpc-server: ggml RPC server on {endpoint}, CPU, {n_threads} thread(s), cache "
          f"{cache.decode() if cache else 'off'}", file=sys.stderr, flush=True)
    done = threading.Event()
    # SIGTERM and SIGHUP raise Interrupted here, as Ctrl-C raises KeyboardInterrupt (run_cli set that up).
    threading.Thread(target=_serve, args=(endpoint.encode(), cache, n_threads, device, done), daemon=True).start()
    try:
        done.wait()
    except (KeyboardInterrupt, Interrupted) as exc:
        line, code = interrupted_line(exc, "RPC server stopped")
        _exit(code, line)
    _exit(EXIT_RUNTIME, f"error: {endpoint}: ggml's RPC server stopped (it could not listen or accept)")


def _exit(code: int, line: str) -> NoReturn:
    """End the process without interpreter teardown (the ggml thread may still be in accept())."""
    print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # ggml's own printf output
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
