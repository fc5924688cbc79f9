"""The built-in K3 template in llama.cpp's own C++ Jinja engine: llama-server, given our template
(--chat-template-file), renders a conversation with tools (POST /apply-template) byte for byte as
our Python render does.

llama-server does not hand a request's messages to the template as sent: it reads them into its
own message structs and writes them back (tools/server/server-common.cpp,
oaicompat_chat_params_parse; common/chat.cpp, common_chat_msgs_parse_oaicompat,
common_chat_msg::to_json_oaicompat and the workarounds of common_chat_templates_apply_jinja).
`as_llama_server_passes_them` is that normalisation, written out; each case is compared with our
render of what it gives (docs/reference/chat-format.md, "In llama-server"). The template variables
go through `chat_template_kwargs`, which llama-server passes into the template's context.
"""
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE, TEMPLATE_SOURCE
from gguf_arch.arch.template_sandbox import compile_template, render
from gguf_arch.errors import KimiError

from tests.support.chat_corpus import Case, corpus

from .llama_tools import llama_server_bin

START_S = 30  # the tiny model loads in well under a second
N_CORPUS = 8  # seeded corpus cases that llama-server takes as they are (see _server_takes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError):
        return 0, None


@pytest.fixture(scope="module")
def server(k3_tiny_gguf, tmp_path_factory) -> Iterator[int]:
    """llama-server on k3-tiny (K3 has no DSA indexer: llama.cpp loads it) with our template; its port."""
    port, log = _free_port(), tmp_path_factory.mktemp("llama-server") / "server.log"
    cmd = [str(llama_server_bin()), "-m", str(k3_tiny_gguf), "--jinja", "--chat-template-file",
           str(TEMPLATE_SOURCE), "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-t", "1", "-np", "1",
           "--no-warmup"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_S
        while _post(port, "/health")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"llama-server did not start: {Path(log).read_text(errors='replace')[-3000:]}"
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _message(m: dict) -> dict:
    """One message as llama-server writes it back for the template."""
    role = "system" if m["role"] == "developer" else m["role"]
    content = m.get("content")
    out: dict[str, Any] = {"role": role, "content": "" if content is None else
                           content if isinstance(content, str) else [{"type": p["type"], "text": p["text"]}
                                                                     for p in content]}
    for key in ("reasoning_content", "name", "tool_call_id"):
        if m.get(key):  # kept when a non-empty string; `reasoning`, `tool` and `id` are dropped
            out[key] = m[key]
    if m.get("tool_calls"):
        out["tool_calls"] = [_call(c) for c in m["tool_calls"]]
    return out


def _call(c: dict) -> dict:
    # The arguments become a string and, since our template reads them as a mapping (llama.cpp's
    # capability probe sees it), are parsed back: a JSON string arrives as typed arguments.
    # Fields other than the name and the arguments (`_xtml_json_block`) are dropped.
    args = c["function"].get("arguments")
    out = {"type": "function", "function": {"name": c["function"]["name"],
                                            "arguments": json.loads(args) if isinstance(args, str) else args}}
    if c.get("id"):
        out["id"] = c["id"]
    return out


def as_llama_server_passes_them(body: dict) -> dict:
    """The template variables llama-server renders `body` with (those our template reads)."""
    out = {"messages": [_message(m) for m in body["messages"]], **body.get("chat_template_kwargs", {}),
           "add_generation_prompt": body.get("add_generation_prompt", True)}
    if body.get("tools"):  # each tool rebuilt from its name, description ("" if none) and parameters
        out["tools"] = [{"type": "function", "function": {"name": t["function"]["name"],
                                                          "description": t["function"].get("description", ""),
                                                          "parameters": t["function"].get("parameters", {})}}
                        for t in body["tools"]]
    return out


def _body(case: Case) -> dict:
    kw = dict(case.kwargs)
    body = {"messages": case.messages, "add_generation_prompt": kw.pop("add_generation_prompt")}
    if kw.get("tools"):
        body["tools"] = kw.pop("tools")
    kw.pop("tools", None)
    return {**body, "chat_template_kwargs": kw}


def _server_takes(case: Case) -> bool:
    """What llama-server refuses or rewrites past the normalisation above: image parts (it takes
    text and its own media markers), lazily loaded tools (a system message without content), a
    call without OpenAI's wrapper or with blank arguments (not JSON), a null reasoning_content, and
    a conversation that ends with an assistant turn (it continues that turn instead)."""
    for m in case.messages:
        if isinstance(m.get("content"), list) and any(p["type"] != "text" for p in m["content"]):
            return False
        if "tools" in m or ("reasoning_content" in m and m["reasoning_content"] is None):
            return False
        for c in m.get("tool_calls", []):
            args = c.get("function", {}).get("arguments")
            if "function" not in c or "arguments" not in c["function"] or (isinstance(args, str) and not args.strip()):
                return False
    return case.messages[-1]["role"] != "assistant"


WEATHER = {"type": "function", "function": {
    "name": "get_Weather", "description": 'Weather & "more" 天气 🌦',
    "parameters": {"type": "object", "required": ["City"], "properties": {
        "City": {"type": "string"}, "alpha": {"type": "number", "minimum": 0.5},
        "Nested": {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "integer"}},
                                                    "B": {"type": "boolean"}}}}}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_Weather", "arguments": {
             "City": 'Paris & "Lyon" <|close|>', "Nested": {"b": [1, 2], "B": True}, "alpha": 0.5, "z": None}}},
         {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x", "n": 3}'}}]
HANDWRITTEN = [
    # Results out of order by id, thinking on at high effort, tools required, a JSON schema.
    Case([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather? 你好 & \"quotes\""},
          {"role": "assistant", "content": "", "reasoning_content": "Two calls.", "tool_calls": CALLS},
          {"role": "tool", "tool_call_id": "c2", "content": "found"},
          {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny ☀"}]},
          {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}],
         {"tools": [WEATHER, LOOKUP], "thinking_effort": "high", "tool_choice": "required", "add_generation_prompt": True,
          "response_format": {"type": "json_schema", "json_schema": {"name": "R", "schema": {"b": 1, "B": 2}}}}),
    # Thinking off, tools forbidden, raw JSON; results by name and by position; a named user.
    Case([{"role": "user", "name": 'Ann & "Bo"', "content": "Go"},
          {"role": "assistant", "content": None, "tool_calls": CALLS},
          {"role": "tool", "name": "lookup", "content": "a"}, {"role": "tool", "content": "b"}],
         {"tools": [WEATHER, LOOKUP], "thinking": False, "tool_choice": "none", "add_generation_prompt": False,
          "response_format": {"type": "json_object"}}),
    # No tools; low effort; a developer message (llama-server makes it a system message).
    Case([{"role": "developer", "content": "dev"}, {"role": "user", "content": "q"}],
         {"thinking_effort": "low", "add_generation_prompt": True}),
]


def _cases() -> list[Case]:
    return HANDWRITTEN + [c for c in corpus(7, 200) if _server_takes(c)][:N_CORPUS]


CASE_IDS = ["tools-by-id", "tools-by-name-and-position", "developer"] + [f"corpus{i}" for i in range(N_CORPUS)]


@pytest.fixture(scope="module")
def ours():
    return compile_template(K3_CHAT_TEMPLATE, "built-in K3 template")


@pytest.mark.parametrize("case", _cases(), ids=CASE_IDS)
def test_llama_servers_engine_renders_our_template_as_python_does(server, ours, case):
    body = _body(case)
    status, reply = _post(server, "/apply-template", body)
    assert status == 200, reply
    want = render(ours, "ours", KimiError, **as_llama_server_passes_them(body))
    assert reply["prompt"] == want


def test_what_llama_server_changes_before_rendering(ours):
    """The normalisation, seen in our render: a JSON-string call becomes typed arguments, a tool
    without a description gets an empty one, and a developer turn is a system turn."""
    first, second, third = (render(ours, "ours", KimiError, **as_llama_server_passes_them(_body(c)))
                            for c in HANDWRITTEN)
    assert '<|open|>argument key="q" type="string"<|sep|>x' in first and '<|open|>json type="object"' not in first
    assert '"description":"","name":"lookup"' in first
    assert third.count('message role="system"<|sep|>dev') == 1
