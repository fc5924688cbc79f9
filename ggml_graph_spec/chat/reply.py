"""A K3 reply, parsed token by token into what OpenAI's API returns: the think channel
(`reasoning_content`), the response channel (`content`) and the tools section (`tool_calls`).

    parser = ReplyParser(tokenizer, start="think", tools=tools)
    for token in sampled:
        is_content = parser.feed(token)     # the generator's `show`: only content is reply text
        for delta in parser.take():         # what this token adds, in order
            ...
    reply = parser.finish()                 # the whole reply; the last deltas in parser.take()

Markers are special tokens; tag names and attributes are text between a marker and `<|sep|>`. The
rules follow llama.cpp's K3 parser (common/parsers/kimi-k3.cpp) where it has one: reasoning ends at
`<|close|>think<|sep|>` or at `<|open|>response<|sep|>`; content ends at `<|close|>response<|sep|>`,
`<|open|>tools<|sep|>` or the message's closer, so a reply cut short still parses; an argument's
type comes from the tool's schema (tools.py). Markup never reaches `content`.

A call is reported (a `call` delta, then `arguments` pieces that concatenate to its JSON object)
as it is written: the call's header once its tool is known to be declared, a raw string
argument's text token by token, a JSON argument whole once it parses. A fault (an undeclared
tool, an argument that is not JSON, a json block that is not an object, a tag that is not K3's)
ends the tools section: what was reported stays, nothing more of the section is, and the reply's
`error` says what it was. Under a grammar (grammar.py) none of these can happen; a reply cut by
max_tokens leaves its last call open (its arguments unfinished), which `open_call` tells.
"""
from __future__ import annotations

import codecs
import json
import secrets
from dataclasses import dataclass, field
from typing import Callable, Sequence

from gguf_arch.arch import xtml

from ..text.tokenizer import BPETokenizer
from .tools import Tool, dumps


@dataclass(frozen=True)
class Delta:
    kind: str  # reasoning | content | call | arguments
    text: str = ""  # reasoning/content text, or an arguments piece
    index: int = 0  # the call's position in the reply (call, arguments)
    name: str = ""  # call: the tool
    id: str = ""  # call: its id


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    error: str = ""  # why the tools section stopped being parsed ("" : it did not)
    open_call: bool = False  # the last call was cut before it closed


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _Text:
    """An incremental UTF-8 decoder for one stretch of text tokens."""

    def __init__(self) -> None:
        self._d = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def partial(self) -> bool:
        """Bytes of a character not complete yet are held."""
        return bool(self._d.getstate()[0])

    def push(self, data: bytes) -> str:
        return self._d.decode(data)

    def flush(self) -> str:
        return self._d.decode(b"", final=True)


class ReplyParser:
    """start: the channel the generation prompt left open ("think", "response"), or "text" for a
    reply of a template that is not K3's (everything is content). reasoning_in_content: `feed`
    counts the think channel's text as content too (llama-server's reasoning_format none); its
    deltas are `reasoning` all the same."""

    def __init__(self, tokenizer: BPETokenizer, start: str = "response", tools: Sequence[Tool] = (), *,
                 reasoning_in_content: bool = False, new_id: Callable[[], str] = call_id) -> None:
        self._tok = tokenizer
        ids = {m: tokenizer.special_id(m) for m in xtml.MARKERS}
        self._open, self._close, self._sep, self._eom = (ids[m] for m in xtml.MARKERS)
        self._tools = {t.name: t for t in tools}
        self._declared = bool(tools)
        self._reasoning_in_content = reasoning_in_content
        self._new_id = new_id
        self.reply = ParsedReply()
        self._deltas: list[Delta] = []
        self.channel = start if start in ("think", "response") else "text"
        self.responded = self.channel == "response"  # the response channel was opened
        self._text = _Text()
        self._tag: bytearray | None = None  # the tag being read after a marker
        self._tag_marker = 0
        self._call: ToolCall | None = None
        self._arg: tuple[str, bool, bytearray | None] | None = None  # key, raw, JSON value's bytes
        self._n_args = 0

    # ---- feeding ---------------------------------------------------------------------------------
    def feed(self, token: int) -> bool:
        """Take one sampled token; True when it is text of the reply's content."""
        if token in (self._open, self._close):
            self._end_text()
            self._tag, self._tag_marker = bytearray(), token
            return False
        if self._tag is not None:
            if token == self._sep:
                self._on_tag(bytes(self._tag).decode("utf-8", "replace"))
                self._tag = None
            elif not self._tok.is_special(token):
                self._tag += self._tok.token_bytes(token)
            return False
        if token == self._eom:
            self._end_text()
            self.channel = "done"
            return False
        if self._tok.is_special(token):
            return False
        return self._on_text(self._tok.token_bytes(token))

    @property
    def mid_character(self) -> bool:
        """The last text token ended inside a UTF-8 character."""
        return self._text.partial

    @property
    def in_tag(self) -> bool:
        """Between a marker and its `<|sep|>`: the tokens there are markup, not channel text."""
        return self._tag is not None

    def take(self) -> list[Delta]:
        out, self._deltas = self._deltas, []
        return out

    def finish(self) -> ParsedReply:
        """The end of the reply (an end-of-generation token, a limit, a cancel)."""
        self._end_text()
        if self._call is not None:
            self.reply.open_call = True
        return self.reply

    # ---- text ------------------------------------------------------------------------------------
    def _content_channel(self) -> bool:
        return self.channel in ("response", "text") or (self.channel == "think" and self._reasoning_in_content)

    def _on_text(self, data: bytes) -> bool:
        if self.channel in ("think", "response", "text"):
            self._emit_text(self._text.push(data))
            return self._content_channel()
        if self.channel == "argument" and self._arg is not None:
            key, raw, buf = self._arg
            if raw:
                self._piece(json.dumps(self._text.push(data), ensure_ascii=False)[1:-1])
            else:
                buf += data
        elif self.channel == "json" and self._arg is not None:
            self._arg[2].extend(data)
        return False  # text between elements is no part of any channel

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self.channel != "think":
            self.reply.content += text
            self._deltas.append(Delta("content", text))
        else:
            self.reply.reasoning += text
            self._deltas.append(Delta("reasoning", text))

    def _end_text(self) -> None:
        tail = self._text.flush()
        if self.channel in ("think", "response", "text"):
            self._emit_text(tail)
        elif tail and self.channel == "argument" and self._arg is not None and self._arg[1]:
            self._piece(json.dumps(tail, ensure_ascii=False)[1:-1])

    # ---- tags ------------------------------------------------------------------------------------
    def _on_tag(self, text: str) -> None:
        if self.channel == "text":  # not K3's markup: a marker's tag is no text of the reply either
            return
        parsed = xtml.parse_tag(text)
        opening = self._tag_marker == self._open
        if parsed is None:
            return self._fault(f"a tag that is not K3's markup: {text[:60]!r}")
        name, attrs = parsed
        handler = (self._on_open if opening else self._on_close)
        handler(name, attrs)

    def _on_open(self, name: str, attrs: dict[str, str]) -> None:
        if name == xtml.RESPONSE and self.channel in ("think", "between"):
            self.channel, self.responded = "response", True
        elif name == xtml.THINK and self.channel == "between" and not self.reply.content:
            self.channel = "think"
        elif name == xtml.TOOLS and self.channel in ("response", "between", "think"):
            self.channel = "tools"
        elif self.channel == "tools" and name == xtml.CALL:
            self._start_call(attrs.get("tool", ""))
        elif self.channel == "call" and name == xtml.ARGUMENT and self._n_args >= 0:
            self._start_argument(attrs.get("key", ""), attrs.get("type"))
        elif self.channel == "call" and name == xtml.JSON_BLOCK and self._n_args == 0:
            self.channel, self._arg = "json", ("", False, bytearray())
        elif self.channel in ("tools", "call", "argument", "json"):
            self._fault(f"<|open|>{name} inside the tools section")

    def _on_close(self, name: str, attrs: dict[str, str]) -> None:
        if name == xtml.THINK and self.channel == "think":
            self.channel = "between"
        elif name == xtml.RESPONSE and self.channel == "response":
            self.channel = "between"
        elif name == xtml.ARGUMENT and self.channel == "argument":
            self._end_argument()
        elif name == xtml.JSON_BLOCK and self.channel == "json":
            self._end_json_block()
        elif name == xtml.CALL and self.channel == "call":
            self._end_call()
        elif name == xtml.TOOLS and self.channel in ("tools", "skip"):
            self.channel = "between"
        elif name == xtml.MESSAGE:
            self.channel = "done"
        elif self.channel in ("tools", "call", "argument", "json"):
            self._fault(f"<|close|>{name} inside the tools section")

    # ---- calls -----------------------------------------------------------------------------------
    def _start_call(self, name: str) -> None:
        if self._declared and name not in self._tools:
            return self._fault(f"a call of {name!r}, which the request does not declare")
        call = ToolCall(self._new_id(), name)
        self._call, self._n_args = call, 0
        self.reply.tool_calls.append(call)
        self.channel = "call"
        index = len(self.reply.tool_calls) - 1
        self._deltas.append(Delta("call", index=index, name=name, id=call.id))
        self._piece("{")

    def _start_argument(self, key: str, written_type: str | None) -> None:
        tool = self._tools.get(self._call.name) if self._call else None
        raw = tool.raw_string(key, written_type) if tool is not None else written_type in (None, "string")
        self._arg = (key, raw, None if raw else bytearray())
        self.channel = "argument"
        if raw:
            self._piece(("," if self._n_args else "") + dumps(key) + ':"')

    def _end_argument(self) -> None:
        key, raw, buf = self._arg
        if raw:
            self._end_text()
            self._piece('"')
        else:
            text = bytes(buf).decode("utf-8", "replace").strip()
            try:
                json.loads(text)
            except ValueError:
                return self._fault(f"argument {key!r} of {self._call.name!r} is not JSON: {text[:60]!r}")
            self._piece(("," if self._n_args else "") + dumps(key) + ":" + text)
        self._n_args += 1
        self._arg, self.channel = None, "call"

    def _end_json_block(self) -> None:
        text = bytes(self._arg[2]).decode("utf-8", "replace").strip()
        try:
            ok = isinstance(json.loads(text), dict)
        except ValueError:
            ok = False
        if not ok:
            return self._fault(f"the json block of {self._call.name!r} is not a JSON object: {text[:60]!r}")
        self._call.arguments = ""  # the block is the whole object: replaces the "{" already reported
        self._piece_replace(text)
        self._arg, self.channel, self._n_args = None, "call", -1

    def _end_call(self) -> None:
        if self._n_args >= 0:
            self._piece("}")
        self._call, self.channel = None, "tools"

    def _piece(self, text: str) -> None:
        if not text:
            return
        self._call.arguments += text
        self._deltas.append(Delta("arguments", text, index=len(self.reply.tool_calls) - 1))

    def _piece_replace(self, text: str) -> None:
        """A json block: its object is the call's arguments, the "{" reported at the call's start
        included (the block's text is reported without its first brace)."""
        self._call.arguments = text
        self._deltas.append(Delta("arguments", text[1:], index=len(self.reply.tool_calls) - 1))

    def _fault(self, why: str) -> None:
        if not self.reply.error:
            self.reply.error = why
        if self._call is not None and self._call in self.reply.tool_calls and self.channel != "skip":
            self._call = None
        self._arg = None
        self.channel = "skip"
