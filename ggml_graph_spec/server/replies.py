"""What the server sends back, in OpenAI's shapes: chat completions and text completions, whole or
as stream chunks, with `usage` (its `prompt_tokens_details.cached_tokens` from the prompt cache),
log-probabilities, and llama-server's `timings`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..generation.events import TokenEvent
from ..text.tokenizer import BPETokenizer
from .jobs import Result
from .protocol import GenRequest
from .stops import StopText


def usage(result: Result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


@dataclass
class Reply:
    """One reply as it comes: its text (stop strings cut), its log-probabilities."""

    request: GenRequest
    tokenizer: BPETokenizer
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)  # chat: one entry per token
    legacy: dict = field(default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                  "text_offset": []})
    _stops: StopText | None = None

    def __post_init__(self) -> None:
        self._stops = StopText(self.request.stop)

    def push(self, event: TokenEvent) -> tuple[str, list[dict]]:
        """The text this token releases and the chat log-probability entries it adds."""
        piece = self._stops.push(event.text)
        entries = []
        if self.request.logprobs >= 0 and event.token is not None and event.stop != "eog" and not self._stops.stopped:
            entries = [self._entry(event)]
            self.logprobs += entries
            self._legacy(event)
        self.text += piece
        return piece, entries

    def flush(self) -> str:
        tail = self._stops.flush()
        self.text += tail
        return tail

    def finish_reason(self, result: Result) -> str:
        return "stop" if self._stops.stopped else result.finish_reason

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
            choice["message"] = {"role": "assistant", "content": reply.text}
        else:
            choice["text"] = reply.text
        return {**self._head(False), "choices": [choice], "usage": usage(result), "timings": result.timings()}

    def chunk(self, reply: Reply, text: str, entries: list[dict], *, first: bool = False) -> dict:
        choice: dict = {"index": 0, "finish_reason": None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
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
