"""Grammars (llguidance's Lark dialect) for what a K3 reply may be: the tools section of the
declared tools, a JSON response, a grammar of the caller's own, or all of these together.

    reply_grammar(ReplySpec(start="think", tools=tools, choice=choice, response=JsonSchema(s)))

The markers are special tokens (`<|open|>` in a rule matches only that token, never its spelling
in text); element names and attributes are ordinary text, written exactly as the chat template
writes them. A call's arguments follow the tool's schema: its properties in the schema's order,
each required one present, each optional one at most once, no other; a string property's value
raw (K3 writes strings unquoted), any other as JSON of the property's schema. The `index`
attribute takes any number (K3 numbers calls from 1; the parser counts them itself).

`tool_choice` "auto" with nothing else to enforce is lazy (constraint.py): no grammar runs while the
model writes free text; `<|open|>` in the response channel starts `tools_grammar`, which begins
after that marker.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from gguf_arch.arch import xtml

from .tools import Tool, ToolChoice

OPEN, CLOSE, SEP, EOM = (f"<{m[1:-1]}>" for m in xtml.MARKERS)  # `<|open|>`: a special-token reference
TEXT = "/(.|\\n)*/"  # free text: any text tokens, never a special token
# JSON's whitespace, bounded at each place it may go: a model may write pretty-printed JSON, but a
# run of whitespace never ends a reply in place of the JSON it owes (llguidance's default is any
# length).
JSON_OPTIONS = {"whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]{0,64}"}
_XTML_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null",
               "object": "object", "array": "array"}


@dataclass(frozen=True)
class JsonSchema:
    """A JSON response: `schema` {} is any object (response_format json_object)."""

    schema: Any = field(default_factory=lambda: {"type": "object"})


@dataclass(frozen=True)
class Lark:
    """A grammar of the caller's own (llama.cpp's GBNF, converted, or llguidance Lark)."""

    text: str


Response = JsonSchema | Lark | None


@dataclass(frozen=True)
class ReplySpec:
    start: str  # the channel the generation prompt opened: think or response
    tools: Sequence[Tool] = ()
    choice: ToolChoice = ToolChoice("none")
    response: Response = None

    @property
    def lazy(self) -> bool:
        """Only the tools section needs a grammar, once the model opens it."""
        return self.response is None and self.choice.mode == "auto" and bool(self.choice.allowed(self.tools))

    @property
    def constrained(self) -> bool:
        return self.response is not None or self.choice.mode in ("required", "named")


def lit(text: str) -> str:
    """A Lark string literal: JSON's escapes are the dialect's."""
    return json.dumps(text, ensure_ascii=False)


def closed_objects(schema: Any) -> Any:
    """The schema with every object that lists its `properties` and says nothing of others closed
    to them (`additionalProperties: false`), as llama.cpp's and xgrammar's schema converters read
    it: a reply writes the keys the schema names, not made-up ones."""
    if isinstance(schema, list):
        return [closed_objects(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _json(schema: Any) -> str:
    schema = closed_objects(schema)
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    elif schema is True:
        schema = {"x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _types(schema: Any) -> list[str]:
    """The `type` attribute values a property's value may be written with."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
    named = sorted({_XTML_TYPES[k] for k in kinds if k in _XTML_TYPES})
    return named or list(xtml.ARGUMENT_TYPES)


def _raw_string(schema: Any) -> str:
    """A string property's raw value: its enum or const, its length bounds, its pattern."""
    if not isinstance(schema, dict):
        return TEXT
    if "const" in schema and isinstance(schema["const"], str):
        return lit(schema["const"])
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(lit(v) for v in schema["enum"]) + ")" if schema["enum"] else TEXT
    if isinstance(schema.get("pattern"), str):
        return "/" + schema["pattern"].replace("/", "\\/") + "/"
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        return f"/(.|\\n){{{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}}}/"
    return TEXT


def _argument(rule: str, key: str, schema: Any) -> list[str]:
    raw = isinstance(schema, dict) and schema.get("type") == "string"
    types = ["string"] if raw else _types(schema)
    head = lit(f'{xtml.ARGUMENT} key="{xtml.escape_attr(key)}" type="')
    kinds = "(" + " | ".join(lit(t) for t in types) + ")"
    value = f"{rule}_v"
    return [f'{rule}: {OPEN} {head} {kinds} "\\"" {SEP} {value} {CLOSE} {lit(xtml.ARGUMENT)} {SEP}',
            f"{value}: {_raw_string(schema) if raw else _json(schema)}"]


def _call(rule: str, tool: Tool) -> list[str]:
    required = set(tool.required())
    rules, parts = [], []
    for i, (key, schema) in enumerate(tool.properties().items()):
        if schema is False:
            continue
        arg = f"{rule}_a{i}"
        rules += _argument(arg, key, schema)
        parts.append(arg if key in required else arg + "?")
    head = lit(f'{xtml.CALL} tool="{xtml.escape_attr(tool.name)}" index="')
    body = " ".join(parts)
    rules.insert(0, f'{rule}: {OPEN} {head} /[1-9][0-9]{{0,3}}/ "\\"" {SEP} {body} {CLOSE} {lit(xtml.CALL)} {SEP}')
    return rules


def _calls(tools: Sequence[Tool], choice: ToolChoice) -> list[str]:
    """`calls`: one or more calls of the allowed tools (one only without parallel calls)."""
    allowed = choice.allowed(tools)
    rules = [line for i, t in enumerate(allowed) for line in _call(f"call{i}", t)]
    rules.append("call: " + " | ".join(f"call{i}" for i in range(len(allowed))))
    rules.append("calls: call+" if choice.parallel else "calls: call")
    return rules


def _tail() -> str:
    return f"end: {CLOSE} {lit(xtml.MESSAGE)} {SEP} {EOM}"


def tools_grammar(tools: Sequence[Tool], choice: ToolChoice) -> str:
    """The tools section once its `<|open|>` is written, to the end of the message."""
    lines = [f"start: {lit(xtml.TOOLS)} {SEP} calls {CLOSE} {lit(xtml.TOOLS)} {SEP} end", _tail()]
    return _grammar("\n".join(lines + _calls(tools, choice)))


def _grammar(lark: str, subgrammars: Sequence[dict] = ()) -> str:
    return json.dumps({"grammars": [{"lark_grammar": lark}, *subgrammars]}, ensure_ascii=False)


def _response_rule(response: Response) -> tuple[str, list[dict]]:
    """The response channel's body, and the grammars it refers to."""
    if isinstance(response, JsonSchema):
        return _json(response.schema), []
    if isinstance(response, Lark):
        return "@user", [{"name": "user", "lark_grammar": response.text}]
    return TEXT, []


def text_grammar(response: JsonSchema | Lark) -> str:
    """A whole text (a raw completion) that is the response: JSON, or the caller's grammar."""
    body, subgrammars = _response_rule(response)
    return _grammar(f"start: {body}", subgrammars)


def reply_grammar(spec: ReplySpec) -> str:
    """The whole reply, from where the generation prompt left off, as llguidance's grammar JSON."""
    body, subgrammars = _response_rule(spec.response)
    if spec.response is None and spec.choice.mode in ("required", "named"):
        body = '""'  # a reply that must call: the call is all of it (OpenAI's content null)
    allowed = spec.choice.allowed(spec.tools)
    tools = ""
    lines = [_tail(), f"response: {body}"]
    if allowed:
        lines += _calls(spec.tools, spec.choice)
        section = f"{OPEN} {lit(xtml.TOOLS)} {SEP} calls {CLOSE} {lit(xtml.TOOLS)} {SEP}"
        tools = section if spec.choice.mode in ("required", "named") else f"({section})?"
    closing = f"{CLOSE} {lit(xtml.RESPONSE)} {SEP}"
    think = ""
    if spec.start == "think":
        think = f"{TEXT} {CLOSE} {lit(xtml.THINK)} {SEP} {OPEN} {lit(xtml.RESPONSE)} {SEP} "
    lines.insert(0, f"start: {think}response {closing} {tools} end")
    return _grammar("\n".join(lines), subgrammars)
