"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`: what the
anthropic SDK and Claude Code speak), served as a chat completion: system and content blocks
become chat messages (text, base64 images, tool_use -> tool_calls, tool_result -> tool messages,
thinking -> reasoning_content), custom tools become function tools, tool_choice auto / any /
tool / none, `thinking` the think channel (enabled: its budget; disabled: off), output_config's
json_schema format a response_format. The reply becomes content blocks (thinking, text, tool_use)
with stop_reason end_turn / max_tokens / stop_sequence / tool_use; streamed as Anthropic's events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop).
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Mapping

from .bodies import text as text_value
from .errors import ApiError, anthropic_error, bad_request
from .fields import PASSED_ON, MESSAGES, check_fields
from .jobs import Result
from .replies import Piece, Reply
from .streams import sse

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"'{where}.content' must be a string or a list of content blocks")
    return content


def _image(block: dict, where: str) -> dict:
    src = block.get("source")
    if not isinstance(src, dict) or src.get("type") != "base64":
        raise bad_request(f"'{where}.source' must be a base64 image source: this server never fetches a URL")
    return {"type": "image_url", "image_url": {"url": f"data:{src.get('media_type')};base64,{src.get('data')}"}}


def _tool_result(block: dict, where: str) -> dict:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(text_value(b.get("text", ""), f"{where}.content[{i}].text") for i, b in enumerate(content)
                          if isinstance(b, dict) and b.get("type") == "text")
    if not isinstance(content, str):
        raise bad_request(f"'{where}.content' must be a string or text blocks")
    if block.get("is_error"):
        content = "Error: " + content
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content}


def _turn(m: Any, i: int) -> list[dict]:
    """One Anthropic message as chat messages (a user turn's tool results come first, as tool messages)."""
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
        raise bad_request(f"'messages[{i}].role' must be user or assistant")
    results, parts, calls, thinking = [], [], [], ""
    for j, b in enumerate(_blocks(m.get("content"), f"messages[{i}]")):
        where, kind = f"messages[{i}].content[{j}]", b.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": b.get("text", "")})
        elif kind == "image" and role == "user":
            parts.append(_image(b, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(b, where))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": b.get("input", {})}})
        elif kind == "thinking" and role == "assistant":
            thinking += text_value(b.get("thinking", ""), f"{where}.thinking")
        else:
            raise bad_request(f"'{where}' is a {kind!r} block, which a {role} message here cannot hold")
    out = list(results)
    if role == "user" and parts:
        out.append({"role": "user", "content": parts})
    elif role == "assistant":
        msg: dict = {"role": "assistant", "content": parts or None}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = thinking
        out.append(msg)
    return out


def _tools(body: Mapping[str, Any]) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise bad_request(f"'tools[{i}]' is a server tool ({t.get('type') if isinstance(t, dict) else t!r}): "
                              "this server runs none; declare custom tools with an input_schema")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema")}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _choice(value: Any, chat: dict) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    kind = kind if isinstance(kind, str) else None  # looked up in a dict: an unhashable value raised
    names = {"auto": "auto", "any": "required", "none": "none"}
    if kind in names:
        chat["tool_choice"] = names[kind]
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": value.get("name")}}
    else:
        raise bad_request("'tool_choice.type' must be auto, any, tool or none")
    if value.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _thinking(body: Mapping[str, Any], chat: dict) -> None:
    t = body.get("thinking")
    if t is None:
        return
    kind = t.get("type") if isinstance(t, dict) else None
    if kind == "disabled":
        chat["chat_template_kwargs"] = {"thinking": False}
    elif kind == "enabled":
        chat["chat_template_kwargs"] = {"thinking": True}
        chat["reasoning_budget_tokens"] = t.get("budget_tokens")
    elif kind != "adaptive":
        raise bad_request("'thinking.type' must be enabled, disabled or adaptive")


def chat_body(body: Any) -> dict:
    """The chat completion a Messages request asks for."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, MESSAGES, "/v1/messages")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise bad_request("'messages' is required: a non-empty list of messages")
    msgs: list[dict] = []
    system = body.get("system")
    if system is not None:
        joined = system if isinstance(system, str) else "".join(text_value(b.get("text", ""), f"system[{i}].text")
                                                                for i, b in enumerate(_blocks(system, "system")))
        msgs.append({"role": "system", "content": joined})
    for i, m in enumerate(body["messages"]):
        msgs += _turn(m, i)
    chat: dict = {"messages": msgs, "stream": bool(body.get("stream"))}
    chat.update({k: body[k] for k in PASSED_ON if body.get(k) is not None})
    for src, dst in (("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("top_k", "top_k"), ("stop_sequences", "stop")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    _choice(body.get("tool_choice"), chat)
    _thinking(body, chat)
    config = body.get("output_config") if isinstance(body.get("output_config"), dict) else {}
    fmt = config.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]
    return chat


class MessagesApi:
    """The reply as Anthropic's message and its stream's events."""

    def __init__(self, model: str) -> None:
        self.id, self.model = "msg_" + secrets.token_hex(12), model
        self.blocks: list[dict] = []
        self._calls: dict[int, int] = {}  # a call's index -> its block's
        self._open: int | None = None  # the block text is being added to

    def _message(self, reply: Reply | None = None, result: Result | None = None) -> dict:
        usage = {"input_tokens": result.prompt_tokens if result else 0, "output_tokens": result.completion_tokens
                 if result else 0, "cache_read_input_tokens": result.cached_tokens if result else 0,
                 "cache_creation_input_tokens": 0}
        stop, matched = (self._stop(reply, result) if result else (None, None))
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [_final(b) for b in self.blocks] if result else [], "stop_reason": stop,
                "stop_sequence": matched, "usage": usage}

    @staticmethod
    def _stop(reply: Reply, result: Result) -> tuple[str, str | None]:
        if reply.stop_matched is not None:
            return "stop_sequence", reply.stop_matched
        return STOP_REASONS.get(reply.finish_reason(result), "end_turn"), None

    # ---- events ----------------------------------------------------------------------------------
    def _push(self, piece: Piece) -> list[bytes]:
        kind = piece[0]
        if kind in ("reasoning", "content"):
            block_type, key = ("thinking", "thinking") if kind == "reasoning" else ("text", "text")
            out = []
            if self._open is None or self.blocks[self._open]["type"] != block_type:
                out += self._close()
                block = {"type": block_type, key: ""} | ({"signature": ""} if block_type == "thinking" else {})
                self.blocks.append(block)
                self._open = len(self.blocks) - 1
                out.append(sse({"type": "content_block_start", "index": self._open, "content_block": dict(block)},
                               "content_block_start"))
            self.blocks[self._open][key] += piece[1]
            delta = {"type": f"{block_type}_delta" if block_type == "thinking" else "text_delta", key: piece[1]}
            return out + [sse({"type": "content_block_delta", "index": self._open, "delta": delta},
                              "content_block_delta")]
        if kind == "call":
            _, index, call_id, name = piece
            out = self._close()
            self.blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": {}, "_json": ""})
            self._calls[index] = self._open = len(self.blocks) - 1
            start = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
            return out + [sse({"type": "content_block_start", "index": self._open, "content_block": start},
                              "content_block_start")]
        _, index, text = piece
        block = self._calls[index]
        self.blocks[block]["_json"] += text
        return [sse({"type": "content_block_delta", "index": block,
                     "delta": {"type": "input_json_delta", "partial_json": text}}, "content_block_delta")]

    def _close(self) -> list[bytes]:
        index, self._open = self._open, None
        if index is None:
            return []
        out = []
        if self.blocks[index]["type"] == "thinking":
            out.append(sse({"type": "content_block_delta", "index": index,
                            "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta"))
        return out + [sse({"type": "content_block_stop", "index": index}, "content_block_stop")]

    def _pieces(self, text: str, pieces: list[Piece]) -> list[bytes]:
        out = [c for p in pieces for c in self._push(p)]
        return out + (self._push(("content", text)) if text else [])

    def start(self) -> list[bytes]:
        return [sse({"type": "message_start", "message": self._message()}, "message_start")]

    def token(self, reply: Reply, text: str, _entries: list[dict], pieces: list[Piece]) -> list[bytes]:
        return self._pieces(text, pieces)

    def end(self, reply: Reply, result: Result, tail: str) -> list[bytes]:
        out = self._pieces(tail, []) + self._close()
        stop, matched = self._stop(reply, result)
        out.append(sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": matched},
                        "usage": {"output_tokens": result.completion_tokens}}, "message_delta"))
        return out + [sse({"type": "message_stop"}, "message_stop")]

    def error(self, error: ApiError) -> list[bytes]:
        return [sse(anthropic_error(error), "error")]

    def collect(self, reply: Reply, text: str, pieces: list[Piece]) -> None:
        self._pieces(text, pieces)

    def whole(self, reply: Reply, result: Result) -> dict:
        return self._message(reply, result)


def _final(block: dict) -> dict:
    if block["type"] != "tool_use":
        return dict(block)
    try:
        args = json.loads(block["_json"]) if block["_json"] else {}
    except ValueError:  # a call cut by max_tokens: its input so far is not JSON yet
        args = {}
    return {"type": "tool_use", "id": block["id"], "name": block["name"], "input": args}
