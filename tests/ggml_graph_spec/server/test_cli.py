"""The kimi-k3-server command as a user runs it: the summary at start, /health while loading and
after, an in-flight stream ended by SIGTERM or SIGINT with exit code 0, the API key, slot files,
and one `error:` line for bad arguments."""
from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from gguf_arch.errors import EXIT_BAD_INPUT, EXIT_RUNTIME
from ggml_graph_spec.server.service import bind
from tests.support.paths import REPO
from tests.support.server import WAIT_S

COMMAND = [sys.executable, "-m", "ggml_graph_spec.server.cli"]


class Running:
    """The command in a child process; its stderr lines go through a queue (a reader thread)."""

    def __init__(self, *argv) -> None:
        self.proc = subprocess.Popen([*COMMAND, *map(str, argv)], cwd=REPO, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self.read_until(r"server is listening on (http://\S+) ").group(1)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def read_until(self, pattern: str) -> re.Match:
        while True:
            line = self._queue.get(timeout=WAIT_S)
            assert line is not None, f"the server ended (exit {self.proc.wait()}): {self.lines}"
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m

    def stop(self, signum: int) -> tuple[int, str]:
        """Send the signal; the exit code and the stderr lines after it."""
        self.proc.send_signal(signum)
        code = self.proc.wait(timeout=WAIT_S)
        rest = []
        while (line := self._queue.get(timeout=WAIT_S)) is not None:
            rest.append(line)
        return code, "\n".join(rest)


def _usage_error(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *map(str, argv)], cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_in_flight_stream_and_exits_0(k3_tiny_gguf, signum):
    # -c 8192 on one slot: the stream below could run for thousands of tokens; the signal ends it.
    server = Running("-m", k3_tiny_gguf, "--port", 0, "-np", 1, "-c", 8192, "-t", 1)
    assert "print_info: slots            = 1 (-np), 8192 tokens of context each" in server.lines
    assert any(line.startswith("print_info: prompt cache     = each slot's history, and up to 1 checkpoint")
               for line in server.lines)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    body = {"prompt": "Once", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        code, rest = server.stop(signum)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert code == 0, rest
    assert events[-1]["error"]["code"] == 503 and events[-1]["error"]["message"] == "the server is shutting down"
    assert f"stopping ({signal.Signals(signum).name})" in rest and "Traceback" not in rest


def test_the_api_key_guards_all_but_the_public_endpoints(k3_tiny_gguf, tmp_path):
    server = Running("-m", k3_tiny_gguf, "--port", 0, "-c", 512, "-t", 1, "--api-key", "s3cret",
                     "--slot-save-path", tmp_path / "slots")
    try:
        for path in ("/health", "/v1/models", "/"):
            assert httpx.get(server.url + path).status_code == 200
        for key in (None, "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert httpx.get(server.url + "/metrics", headers=headers).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=good)
        assert r.status_code == 200
        saved = httpx.post(server.url + "/slots/0?action=save", json={"filename": "a.bin"}, headers=good).json()
        assert saved["n_saved"] > 0 and (tmp_path / "slots" / "a.bin").stat().st_size == saved["n_written"]
    finally:
        assert server.stop(signal.SIGTERM)[0] == 0


def test_a_taken_port_is_one_error_line_and_exit_1(k3_tiny_gguf):
    sock = bind("127.0.0.1", 0)
    try:
        r = _usage_error("-m", k3_tiny_gguf, "--port", sock.getsockname()[1])
    finally:
        sock.close()
    assert r.returncode == EXIT_RUNTIME and r.stderr.startswith("error: cannot listen on 127.0.0.1:")
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize("argv, needle", [
    (["--port", 70000], "--port must be in [0, 65535]"),
    (["--timeout", 0], "--timeout must be a positive number"),
    (["--queue", -1], "--queue must be >= 0"),
    (["--max-body", "lots"], "expected a size such as 512K"),
    (["-np", 0], "-np/--parallel (n_seq) must be an integer >= 1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_are_one_error_line_and_exit_2(k3_tiny_gguf, argv, needle):
    r = _usage_error("-m", k3_tiny_gguf, *argv)
    assert r.returncode == EXIT_BAD_INPUT and r.stderr.startswith("error: ") and needle in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


def test_another_host_without_a_key_is_warned_about(k3_tiny_gguf):
    from ggml_graph_spec.server.cli import build_parser, check

    a = build_parser().parse_args(["-m", str(k3_tiny_gguf), "--host", "0.0.0.0"])
    assert any(n.startswith("warning: listening on 0.0.0.0 without --api-key") for n in check(a))
    a = build_parser().parse_args(["-m", str(k3_tiny_gguf), "--host", "0.0.0.0", "--api-key", "k"])
    assert not any(n.startswith("warning") for n in check(a))
    assert not any(n.startswith("warning") for n in check(build_parser().parse_args(["-m", "x"])))


def test_health_is_503_while_the_model_loads(k3_tiny_gguf):
    from ggml_graph_spec.server.app import HttpSettings, Server
    from ggml_graph_spec.server.service import Service

    service = Service(Server(HttpSettings("m", None, 1 << 20, 10.0, None), print), bind("127.0.0.1", 0))
    try:
        r = httpx.get(service.address + "/health")
        assert r.status_code == 503 and r.json()["error"] == {"code": 503, "message": "Loading model",
                                                              "type": "unavailable_error"}
        assert httpx.post(service.address + "/v1/completions", json={"prompt": "x"}).status_code == 503
    finally:
        assert service.stop()
