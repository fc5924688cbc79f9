"""What the server sends back, in OpenAI's shapes: chat completions and text completions, whole or
as stream chunks, with `usage` (its `prompt_tokens_details.cached_tokens` from the prompt cache),
log-probabilities, and llama-server's `timings`.

A chat reply's parts come from the reply parser (chat/reply.py): `content` (stop strings cut),
`reasoning_content` (the think channel, unless reasoning_format is none) and `tool_calls`, each
streamed as OpenAI streams it (`delta.reasoning_content`, `delta.content`, `delta.tool_calls[i]`
with the call's id and name first, then pieces of its `arguments`). The whole reply is what the
stream's pieces add up to.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from typing import Union

from ..chat.reply import Delta
from ..generation.events import TokenEvent
from ..text.tokenizer import BPETokenizer
from .jobs import Result
from .protocol import GenRequest
from .stops import StopText


def usage(result: Result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


# A part of a reply as every API's shapes take it: ("reasoning", text), ("content", text),
# ("call", index, id, name), ("arguments", index, text).
Piece = Union[tuple[str, str], tuple[str, int, str, str], tuple[str, int, str]]


@dataclass
class Reply:
    """One reply as it comes: its text (stop strings cut), reasoning, tool calls, log-probabilities."""

    request: GenRequest
    tokenizer: BPETokenizer
    text: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)  # OpenAI's tool_calls, arguments growing
    reasoning_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)  # chat: one entry per token
    legacy: dict = field(default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                  "text_offset": []})
    _stops: StopText | None = None

    def __post_init__(self) -> None:
        self._stops = StopText(self.request.stop)

    def push(self, event: TokenEvent, deltas: list[Delta] = ()) -> tuple[str, list[dict], list[Piece]]:
        """What this token releases: its content text, the chat log-probability entries it adds, and
        the reply's other pieces it adds (reasoning, tool calls), in order."""
        piece = self._stops.push(event.text)
        entries = []
        if self.request.logprobs >= 0 and event.token is not None and event.stop != "eog" and not self._stops.stopped:
            entries = [self._entry(event)]
            self.logprobs += entries
            self._legacy(event)
        self.text += piece
        pieces = [p for p in map(self._part, deltas) if p is not None]
        self.reasoning_tokens += any(p[0] == "reasoning" for p in pieces)
        return piece, entries, pieces

    def _part(self, d: Delta) -> Piece | None:
        reply = self.request.reply
        if d.kind == "reasoning":
            if reply is None or not reply.reasoning_separate:
                return None
            self.reasoning += d.text
            return ("reasoning", d.text)
        if d.kind == "call":
            self.calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            return ("call", d.index, d.id, d.name)
        if d.kind == "arguments":
            self.calls[d.index]["function"]["arguments"] += d.text
            return ("arguments", d.index, d.text)
        return None  # content: the token's own text (event.text), stop strings applied

    def flush(self) -> str:
        tail = self._stops.flush()
        self.text += tail
        return tail

    @property
    def stop_matched(self) -> str | None:
        return self._stops.matched

    def finish_reason(self, result: Result) -> str:
        if self._stops.stopped:
            return "stop"
        if self.calls and result.finish_reason == "stop":
            return "tool_calls"
        return result.finish_reason

    def message(self) -> dict:
        """The whole chat message."""
        msg: dict = {"role": "assistant", "content": self.text if self.text or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg

    def _piece(self, token: int) -> tuple[str, list[int]]:
        data = self.tokenizer.token_bytes(token)
        return data.decode("utf-8", errors="replace"), list(data)

    def _entry(self, event: TokenEvent) -> dict:
        text, data = self._piece(event.token)
        top = []
        for token, lp in event.top_logprobs or []:
            t, d = self._piece(token)
            top.append({"token": t, "logprob": lp, "bytes": d})
        return {"token": text, "logprob": event.logprob, "bytes": data, "top_logprobs": top}

    def _legacy(self, event: TokenEvent) -> None:
        text, _ = self._piece(event.token)
        self.legacy["text_offset"].append(len(self.text))
        self.legacy["tokens"].append(text)
        self.legacy["token_logprobs"].append(event.logprob)
        self.legacy["top_logprobs"].append({self._piece(t)[0]: lp for t, lp in event.top_logprobs or []})


class Shapes:
    """The JSON objects of one request: chat.completion(.chunk) or text_completion."""

    def __init__(self, model: str, chat: bool, job_id: int) -> None:
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{job_id}-{time.time_ns():x}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "kimi-k3-gguf"}

    def _logprobs(self, reply: Reply, entries: list[dict] | None = None) -> dict | None:
        if reply.request.logprobs < 0:
            return None
        if self.chat:
            return {"content": reply.logprobs if entries is None else entries}
        return reply.legacy

    def whole(self, reply: Reply, result: Result) -> dict:
        choice = {"index": 0, "logprobs": self._logprobs(reply), "finish_reason": reply.finish_reason(result)}
        if self.chat:
            choice["message"] = reply.message()
        else:
            choice["text"] = reply.text
        return {**self._head(False), "choices": [choice], "usage": usage(result), "timings": result.timings()}

    def chunk(self, reply: Reply, text: str, entries: list[dict], *, first: bool = False,
              piece: Piece | None = None) -> dict:
        """A stream chunk: content text (with its log-probabilities), or one other piece of the
        reply (reasoning_content, tool_calls)."""
        choice: dict = {"index": 0, "finish_reason": None}
        if self.chat:
            delta = _delta(piece) if piece is not None else {"content": text}
            choice["delta"] = {"role": "assistant", **delta} if first else delta
            choice["logprobs"] = self._logprobs(reply, entries) if entries else None
        else:
            choice["text"] = text
            choice["logprobs"] = None
        return {**self._head(True), "choices": [choice]}

    def last_chunk(self, reply: Reply, result: Result, tail: str) -> dict:
        choice: dict = {"index": 0, "finish_reason": reply.finish_reason(result)}
        if self.chat:
            choice["delta"] = {"content": tail} if tail else {}
            choice["logprobs"] = None
        else:
            choice["text"] = tail
            choice["logprobs"] = self._logprobs(reply)
        return {**self._head(True), "choices": [choice], "timings": result.timings()}

    def usage_chunk(self, result: Result) -> dict:
        return {**self._head(True), "choices": [], "usage": usage(result)}


def _delta(piece: Piece) -> dict:
    """A chat stream's delta of one piece."""
    if piece[0] == "reasoning":
        return {"reasoning_content": piece[1]}
    if piece[0] == "call":
        _, index, call_id, name = piece
        return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}
    _, index, text = piece
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
