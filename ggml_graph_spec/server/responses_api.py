"""OpenAI's Responses API (`POST /v1/responses`, what the openai-agents SDK speaks by default), served
as a chat completion: the request becomes a chat request (input items -> messages, function
tools, text.format -> response_format, reasoning.effort -> reasoning_effort), and the reply's
parts become the response's output items: a `reasoning` item (the think channel), a `message`
with its `output_text`, one `function_call` item per tool call; streamed as the API's events
(response.created ... response.output_text.delta ... response.completed).

Nothing is stored: `previous_response_id` and `conversation` are refused, `store` must be false
or absent (fields.py).
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any, Mapping

from .bodies import text as text_value
from .errors import ApiError, bad_request
from .fields import PASSED_ON, RESPONSES, check_fields
from .jobs import Result
from .replies import Piece, Reply
from .streams import sse


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(content: Any, where: str) -> str | list:
    """An input message's content as chat content: a string, or chat parts (text and images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            url = part.get("image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad_request(f"'{where}.content[{j}]' is a {kind!r} part: this server takes input_text and "
                              "input_image (data: URIs)")
    return parts


def _messages(body: Mapping[str, Any]) -> list[dict]:
    """`instructions` and `input` as chat messages: function calls join the assistant turn they
    follow, a reasoning item gives that turn its reasoning_content."""
    msgs: list[dict] = []
    if isinstance(body.get("instructions"), str):
        msgs.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("'input' is required: a string or a list of input items")
    pending_reasoning = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            msgs.append({"role": item["role"], "content": _text_of(item.get("content"), where)})
        elif kind == "reasoning":
            texts = [text_value(c.get("text", ""), f"{where}.text")
                     for c in item.get("content") or item.get("summary") or [] if isinstance(c, dict)]
            pending_reasoning = "".join(texts)
            continue
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if not msgs or msgs[-1]["role"] != "assistant" or msgs[-1].get("_closed"):
                msgs.append({"role": "assistant", "content": None})
            msgs[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out, ensure_ascii=False)})
        else:
            raise bad_request(f"'{where}' is a {kind!r} item: this server takes messages, function_call, "
                              "function_call_output and reasoning items")
        if pending_reasoning is not None and msgs[-1]["role"] == "assistant":
            msgs[-1]["reasoning_content"], pending_reasoning = pending_reasoning, None
    return msgs


def _tools(body: Mapping[str, Any]) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f"'tools[{i}]' is a {t.get('type') if isinstance(t, dict) else t!r} tool: this server "
                              "runs function tools only (the caller runs them)")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _format(text: Any) -> dict | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object: {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                          "{\"type\": \"json_schema\", \"schema\": ...}")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    raise bad_request("'text.format.type' must be text, json_object or json_schema")


def chat_body(body: Any) -> dict:
    """The chat completion a Responses request asks for."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, RESPONSES, "/v1/responses")
    chat: dict = {"messages": _messages(body), "stream": bool(body.get("stream"))}
    chat.update({k: body[k] for k in PASSED_ON if body.get(k) is not None})
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("top_logprobs", "top_logprobs")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if body.get("top_logprobs") is not None:
        chat["logprobs"] = True
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    effort = body.get("reasoning", {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


class ResponseOutput:
    """The response object of one request, built as its reply comes, with the stream's events."""

    def __init__(self, model: str, request: Mapping[str, Any]) -> None:
        self.id, self.model, self.created = _id("resp"), model, int(time.time())
        self.request = request
        self.items: list[dict] = []
        self._open: dict | None = None  # the item text is being added to
        self._calls: dict[int, dict] = {}
        self._seq = 0

    # ---- the stream's events ---------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def start(self) -> list[dict]:
        head = self.response("in_progress")
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    def push(self, piece: Piece) -> list[dict]:
        kind = piece[0]
        if kind in ("reasoning", "content"):
            return self._text(kind, piece[1])
        if kind == "call":
            return self._call(*piece[1:])
        return self._arguments(*piece[1:])

    def _text(self, kind: str, text: str) -> list[dict]:
        item_kind = "reasoning" if kind == "reasoning" else "message"
        events = []
        if self._open is None or self._open["type"] != item_kind:
            events += self._close()
            item = ({"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                     "content": [{"type": "reasoning_text", "text": ""}]} if item_kind == "reasoning" else
                    {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                     "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]})
            self.items.append(item)
            self._open = item
            index = len(self.items) - 1
            events.append(self._event("response.output_item.added", output_index=index, item=_copy(item)))
            events.append(self._event("response.content_part.added", output_index=index, item_id=item["id"],
                                      content_index=0, part=_copy(item["content"][0])))
        self._open["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if item_kind == "reasoning" else "response.output_text.delta"
        extra = {} if item_kind == "reasoning" else {"logprobs": []}
        events.append(self._event(delta, output_index=len(self.items) - 1, item_id=self._open["id"], content_index=0,
                                  delta=text, **extra))
        return events

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self.items.index(item)
        part = item["content"][0]
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        return [self._event(done, output_index=index, item_id=item["id"], content_index=0, text=part["text"]),
                self._event("response.content_part.done", output_index=index, item_id=item["id"], content_index=0,
                            part=_copy(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _call(self, index: int, call_id: str, name: str) -> list[dict]:
        events = self._close()
        item = {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": "",
                "status": "in_progress"}
        self.items.append(item)
        self._calls[index] = item
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item)))
        return events

    def _arguments(self, index: int, text: str) -> list[dict]:
        item = self._calls[index]
        item["arguments"] += text
        return [self._event("response.function_call_arguments.delta", output_index=self.items.index(item),
                            item_id=item["id"], delta=text)]

    def finish(self, reply: Reply, result: Result) -> list[dict]:
        events = self._close()
        for item in self._calls.values():
            item["status"] = "completed"
            index = self.items.index(item)
            events.append(self._event("response.function_call_arguments.done", output_index=index,
                                      item_id=item["id"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        status = "incomplete" if result.finish_reason == "length" else "completed"
        whole = self.response(status, result, reply)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=whole)]

    # ---- the response object ---------------------------------------------------------------------
    def response(self, status: str, result: Result | None = None, reply: Reply | None = None) -> dict:
        r = self.request
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": [_copy(i) for i in self.items], "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": r.get("instructions"), "metadata": r.get("metadata") or {},
               "parallel_tool_calls": r.get("parallel_tool_calls", True), "tool_choice": r.get("tool_choice", "auto"),
               "tools": r.get("tools") or [], "temperature": r.get("temperature"), "top_p": r.get("top_p"),
               "max_output_tokens": r.get("max_output_tokens"), "text": r.get("text") or {"format": {"type": "text"}},
               "reasoning": r.get("reasoning"), "store": False, "truncation": "disabled", "usage": None}
        if result is not None:
            reasoning = reply.reasoning_tokens if reply is not None else 0
            out["usage"] = {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
                            "total_tokens": result.prompt_tokens + result.completion_tokens,
                            "input_tokens_details": {"cached_tokens": result.cached_tokens},
                            "output_tokens_details": {"reasoning_tokens": reasoning}}
        return out

    def whole(self, reply: Reply, result: Result) -> dict:
        """The whole response of a request that did not stream (every piece already pushed)."""
        self.finish(reply, result)
        return self.response("incomplete" if result.finish_reason == "length" else "completed", result, reply)


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


class ResponsesApi:
    """The stream adapter (streams.py) of /v1/responses: every event named by its type."""

    def __init__(self, model: str, request: Mapping[str, Any]) -> None:
        self.out = ResponseOutput(model, request)

    @staticmethod
    def _sse(events: list[dict]) -> list[bytes]:
        return [sse(e, event=e["type"]) for e in events]

    def _pieces(self, text: str, pieces: list[Piece]) -> list[dict]:
        events = [e for p in pieces for e in self.out.push(p)]
        return events + (self.out.push(("content", text)) if text else [])

    def start(self) -> list[bytes]:
        return self._sse(self.out.start())

    def token(self, reply: Reply, text: str, _entries: list[dict], pieces: list[Piece]) -> list[bytes]:
        return self._sse(self._pieces(text, pieces))

    def end(self, reply: Reply, result: Result, tail: str) -> list[bytes]:
        return self._sse(self._pieces(tail, []) + self.out.finish(reply, result))

    def error(self, error: ApiError) -> list[bytes]:
        return self._sse([self.out._event("error", code=str(error.status), message=error.message, param=None)])

    def collect(self, reply: Reply, text: str, pieces: list[Piece]) -> None:
        self._pieces(text, pieces)

    def whole(self, reply: Reply, result: Result) -> dict:
        return self.out.whole(reply, result)
