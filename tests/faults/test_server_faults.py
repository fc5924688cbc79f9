"""kimi-k3-server's slot files and stop signals under faults: a full disk during a save (no partial
file, the old one whole), restores of truncated, foreign, hostile or non-regular files and
path-like names (400s, the slot as it was, nothing read outside the directory, never a wait on a
FIFO), SIGTERM in the middle of a save (the file whole, exit 0) and while a stream of each API is
under way (each ends with its API's error event, exit 0, no traceback).

The disk fills in the test's own process (Path.write_bytes writes half, then ENOSPC); the signal
is sent by the child itself from inside the write (a prelude), so both land where chosen."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import queue
import re
import signal
import struct
import threading

import httpx
import pytest

from ggml_graph_spec.engine import state as st
from tests.support.cli import start_tool
from tests.support.server import WAIT_S, LiveServer, LogRecords

PROMPT = {"prompt": "The old woman sold honey in small", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(k3_tiny_gguf, slot_dir):
    s = LiveServer(k3_tiny_gguf, "-np", 2, "-c", 2 * 256, "--slot-save-path", slot_dir)
    yield s
    s.close()


def _fill(server) -> int:
    """One slot holding a prompt and its reply, the other empty: the full one's id."""
    for sid in (0, 1):
        server.http.post(f"/slots/{sid}?action=erase").raise_for_status()
    server.http.post("/v1/completions", json=PROMPT).raise_for_status()
    (full,) = [s["id"] for s in server.slots() if s["n_tokens"]]
    return full


def _save(server, slot: int, name: str) -> httpx.Response:
    return server.http.post(f"/slots/{slot}?action=save", json={"filename": name})


def test_a_full_disk_during_a_save_leaves_no_partial_file_and_the_old_one_whole(server, slot_dir, monkeypatch):
    slot = _fill(server)
    assert _save(server, slot, "kept.bin").status_code == 200
    old = (slot_dir / "kept.bin").read_bytes()
    server.http.post(f"/slots/{slot}?action=erase").raise_for_status()  # what a new save would write differs

    def half_then_full(self, data):
        with open(self, "wb") as f:
            f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(pathlib.Path, "write_bytes", half_then_full)
    with LogRecords() as logs:
        r = _save(server, slot, "kept.bin")
    monkeypatch.undo()
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "No space left on device" in message and "a file of that name is as it was" in message
    assert str(slot_dir) not in r.text and not logs.tracebacks()
    assert (slot_dir / "kept.bin").read_bytes() == old
    assert sorted(p.name for p in slot_dir.iterdir() if "partial" in p.name) == []
    restored = server.http.post(f"/slots/{1 - slot}?action=restore", json={"filename": "kept.bin"})
    assert restored.status_code == 200 and restored.json()["n_read"] == len(old)


def _state_file(slot_dir) -> bytes:
    return (slot_dir / "kept.bin").read_bytes()


def _resealed(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def _with_header(data: bytes, change) -> bytes:
    """A state file whose JSON header `change` edited, its checksum made to match again."""
    start = len(st.MAGIC) + 8
    version, n = struct.unpack_from("<II", data, len(st.MAGIC))
    header = json.loads(data[start:start + n])
    change(header)
    new = json.dumps(header).encode()
    body = data[:len(st.MAGIC)] + struct.pack("<II", version, len(new)) + new + data[start + n:-32]
    return _resealed(body)


HOSTILE_FILES = {
    "truncated": (lambda d: d[:len(d) // 2], "truncated or damaged"),
    "one byte changed": (lambda d: d[:100] + bytes([d[100] ^ 1]) + d[101:], "damaged"),
    "another model": (lambda d: _with_header(d, lambda h: h.update(model="0" * 64)), "saved from another model"),
    "a negative count": (lambda d: _with_header(d, lambda h: h.update(n_tokens=-3)), "negative count"),
    "nested deep": (lambda d: _resealed(d[:len(st.MAGIC)] + struct.pack("<II", 1, 200_000) + b"[" * 200_000),
                    "damaged sequence state header"),
    "not a state": (lambda d: b"PK\x03\x04 a zip file" * 100, "not a kimi-k3 sequence state"),
}


@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_a_damaged_or_foreign_slot_file_is_a_400_and_the_slot_as_it_was(server, slot_dir, kind):
    slot = _fill(server)
    _save(server, slot, "kept.bin").raise_for_status()
    damage, needle = HOSTILE_FILES[kind]
    (slot_dir / "hostile.bin").write_bytes(damage(_state_file(slot_dir)))
    before = server.slots()
    for target in (0, 1):  # into the full slot and into the empty one
        r = server.http.post(f"/slots/{target}?action=restore", json={"filename": "hostile.bin"})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert server.slots() == before


@pytest.mark.parametrize("kind", ["fifo", "directory", "huge"])
def test_a_slot_file_that_is_no_regular_file_or_too_large_is_refused_without_reading_it(server, slot_dir, kind):
    path = slot_dir / f"odd-{kind}.bin"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 40)  # sparse: a terabyte that takes no disk
    r = server.http.post("/slots/1?action=restore", json={"filename": path.name})
    assert r.status_code == 400, r.text
    needle = {"fifo": "not a regular file", "directory": "is a directory", "huge": "more than any sequence state"}
    assert needle[kind] in r.json()["error"]["message"]


@pytest.mark.parametrize("name", ["../x.bin", "/etc/passwd", "a/b.bin", ".hidden", "x\x00y", "a" * 300, "..", "x..y",
                                  "", "\uff41.bin", "a\\b", 5, None, ["x"]])
def test_a_path_like_or_odd_filename_is_a_400_and_nothing_is_written(server, slot_dir, name, tmp_path):
    before = sorted(p.name for p in slot_dir.parent.iterdir()), sorted(p.name for p in slot_dir.iterdir())
    for action in ("save", "restore"):
        r = server.http.post(f"/slots/0?action={action}", json={"filename": name})
        assert r.status_code == 400 and "'filename' must be a plain file name" in r.json()["error"]["message"]
    assert (sorted(p.name for p in slot_dir.parent.iterdir()), sorted(p.name for p in slot_dir.iterdir())) == before


# ---- signals ---------------------------------------------------------------------------------------

# In the child: the slot file's first half written, SIGTERM to itself, then the second half.
SIGNAL_MID_SAVE = """
import os, pathlib, signal
_real = pathlib.Path.write_bytes
def _write(self, data):
    if not self.name.endswith(".partial"):
        return _real(self, data)
    with open(self, "wb") as f:
        f.write(data[:len(data) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGTERM)
        f.write(data[len(data) // 2:])
    return len(data)
pathlib.Path.write_bytes = _write
"""


class Child:
    """kimi-k3-server in a child process; its stderr lines through a queue."""

    def __init__(self, *argv, prelude: str = "") -> None:
        self.proc = start_tool("server", *map(str, argv), prelude=prelude)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self.until(r"server is listening on (http://\S+) ").group(1)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def until(self, pattern: str) -> re.Match:
        while True:
            line = self._queue.get(timeout=WAIT_S)
            assert line is not None, f"the server ended: {self.lines}"
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m

    def end(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=WAIT_S)
        while (line := self._queue.get(timeout=WAIT_S)) is not None:
            self.lines.append(line)
        return code, "\n".join(self.lines)


def test_sigterm_in_the_middle_of_a_slot_save_leaves_the_file_whole(k3_tiny_gguf, tmp_path):
    args = ("-m", k3_tiny_gguf, "--port", 0, "-np", 1, "-c", 256, "-t", 1, "--slot-save-path", tmp_path)
    child = Child(*args, prelude=SIGNAL_MID_SAVE)
    httpx.post(child.url + "/v1/completions", json=PROMPT, timeout=WAIT_S).raise_for_status()
    try:
        saved = httpx.post(child.url + "/slots/0?action=save", json={"filename": "s.bin"}, timeout=WAIT_S).json()
    except httpx.HTTPError:  # the stop may close the connection before the answer: the file tells
        saved = None
    code, err = child.end()
    assert code == 0 and "stopping (SIGTERM)" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]
    again = Child(*args)
    try:
        restored = httpx.post(again.url + "/slots/0?action=restore", json={"filename": "s.bin"}, timeout=WAIT_S)
        assert restored.status_code == 200, restored.text
        assert saved is None or restored.json()["n_restored"] == saved["n_saved"]
    finally:
        again.proc.send_signal(signal.SIGTERM)
        again.end()


STREAMS = {  # a request of each API, and how its stream's error event reads
    "/v1/completions": ({"prompt": "Once"}, lambda e: e["error"]["code"] == 503),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}]}, lambda e: e["error"]["code"] == 503),
    "/v1/responses": ({"input": "Hi", "max_output_tokens": 8000}, lambda e: e["type"] == "error"
                      and e["code"] == "503"),
    "/v1/messages": ({"messages": [{"role": "user", "content": "Hi"}]}, lambda e: e["type"] == "error"
                     and e["error"]["type"] == "overloaded_error"),
}


def _first_event_then_rest(url: str, path: str, body: dict, started: threading.Event, out: dict) -> None:
    body = {"max_tokens": 8000, **body, "stream": True, "ignore_eos": True}
    if path == "/v1/responses":
        body.pop("max_tokens")
    with httpx.stream("POST", url + path, json=body, timeout=WAIT_S) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    out[path] = events


def test_sigterm_while_a_stream_of_each_api_runs_ends_each_with_its_error_event(k3_tiny_gguf):
    child = Child("-m", k3_tiny_gguf, "--port", 0, "-np", 4, "-c", 4 * 8192, "-t", 1)
    out: dict = {}
    threads = []
    for path, (body, _) in STREAMS.items():
        started = threading.Event()
        threads.append(threading.Thread(target=_first_event_then_rest, args=(child.url, path, body, started, out)))
        threads[-1].start()
        assert started.wait(WAIT_S), path
    child.proc.send_signal(signal.SIGTERM)
    code, err = child.end()
    for t in threads:
        t.join(WAIT_S)
    assert code == 0 and "stopping (SIGTERM)" in err and "Traceback" not in err, err
    for path, (_, is_error) in STREAMS.items():
        assert is_error(json.loads(out[path][-1])), (path, out[path][-2:])

