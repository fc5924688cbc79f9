"""The requests of bench/agents.py: a 20-tool declaration, a nested JSON schema, and valid K3
replies to them, written as the model writes them and cut into sections.

The tools are OpenAI function declarations (read by the project's own `parse_tools`), each of 2
to 6 arguments drawn from PARAMETERS: strings with an enum, a maxLength or a pattern, integers
and numbers with bounds, booleans, arrays of enums and of objects, nested objects. The JSON
schema is bench/grammar_specs.py's (objects in an array, enums, required fields, patterns).

A reply is a list of (section, text) pieces whose boundaries fall before a marker (a special
token), so that encoding the pieces one by one gives the tokens of the whole text:

  think     the think channel's text (K3 thinks first);
  response  `<|close|>think<|sep|><|open|>response<|sep|>`, the content (tool_choice auto: a few
            sentences; required: none), `<|close|>response<|sep|>`;
  tools     the tools section: one to three calls of declared tools, valid arguments;
  json      the response channel's JSON (instead of the content);
  end       `<|close|>message<|sep|><|end_of_msg|>`.
"""
from __future__ import annotations

import json
import random
from typing import Any, Callable

from bench import grammar_specs as gs
from gguf_arch.arch import xtml
from ggml_graph_spec.chat.grammar import JsonSchema, ReplySpec
from ggml_graph_spec.chat.tools import Tool, dumps, parse_tool_choice, parse_tools

Maker = Callable[[random.Random, list[str]], Any]  # a valid value of the schema, from the lexicon


def words(rng: random.Random, lexicon: list[str], n: int) -> str:
    """Prose of n words of the lexicon (the long tokens of the vocabulary), with punctuation."""
    out = []
    for _ in range(n):
        w = rng.choice(lexicon)
        out.append(w.capitalize() if rng.random() < 0.1 else w)
        if rng.random() < 0.08:
            out[-1] += rng.choice(",.;:?!")
    return " ".join(out)


def _path(rng: random.Random, lexicon: list[str]) -> str:
    return "/" + "/".join(rng.choice(lexicon)[:10] for _ in range(rng.randint(1, 3)))


def _day(rng: random.Random) -> str:
    return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


DAY = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
LABELS = ["bug", "feature", "docs", "urgent", "wontfix", "question"]
# name -> (schema, a maker of valid values). Strings are written raw by K3, the rest as JSON.
PARAMETERS: dict[str, tuple[dict, Maker]] = {
    "query": ({"type": "string", "maxLength": 200, "description": "What to look for"},
              lambda rng, lx: words(rng, lx, rng.randint(2, 12))[:200]),
    "city": ({"type": "string", "maxLength": 64}, lambda rng, lx: words(rng, lx, 2)[:64]),
    "unit": ({"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]},
             lambda rng, lx: rng.choice(["celsius", "fahrenheit", "kelvin"])),
    "path": ({"type": "string", "pattern": "^/[a-z0-9_/.-]{1,60}$"}, _path),
    "limit": ({"type": "integer", "minimum": 1, "maximum": 100}, lambda rng, lx: rng.randint(1, 100)),
    "offset": ({"type": "integer", "minimum": 0}, lambda rng, lx: rng.randint(0, 5000)),
    "ratio": ({"type": "number", "minimum": 0, "maximum": 1}, lambda rng, lx: round(rng.random(), 3)),
    "recursive": ({"type": "boolean"}, lambda rng, lx: rng.random() < 0.5),
    "mode": ({"type": "string", "enum": ["fast", "exact", "dry-run"]},
             lambda rng, lx: rng.choice(["fast", "exact", "dry-run"])),
    "priority": ({"type": "integer", "enum": [1, 2, 3, 4, 5]}, lambda rng, lx: rng.randint(1, 5)),
    "body": ({"type": "string", "maxLength": 2000}, lambda rng, lx: words(rng, lx, rng.randint(10, 60))[:2000]),
    "labels": ({"type": "array", "items": {"type": "string", "enum": LABELS}, "maxItems": 4},
               lambda rng, lx: rng.sample(LABELS, rng.randint(0, 4))),
    "window": ({"type": "object", "properties": {"start": DAY, "end": DAY}, "required": ["start", "end"]},
               lambda rng, lx: {"start": _day(rng), "end": _day(rng)}),
    "recipients": ({"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 80},
                                         "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.org$"}},
        "required": ["email"]}},
        lambda rng, lx: [{"name": words(rng, lx, 2)[:80], "email": "ann@example.org"}
                         for _ in range(rng.randint(1, 4))]),
    "filters": ({"type": "object", "properties": {
        "status": {"type": "array", "items": {"type": "string", "enum": ["open", "closed", "draft"]}},
        "owner": {"type": "string", "maxLength": 40},
        "created": {"type": "object", "properties": {"after": DAY, "before": DAY}}}},
        lambda rng, lx: {"status": rng.sample(["open", "closed", "draft"], rng.randint(1, 3)),
                         "owner": rng.choice(lx)[:40], "created": {"after": _day(rng)}}),
}
XTML_TYPE = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
             "array": "array", "object": "object"}


def declaration(seed: int) -> list[dict]:
    """20 OpenAI function tools: each 2-6 of PARAMETERS in their order, the first one or two required."""
    rng, names = random.Random(seed), list(PARAMETERS)
    tools = []
    for name in gs.TOOL_NAMES:
        chosen = [names[i] for i in sorted(rng.sample(range(len(names)), rng.randint(2, 6)))]
        props = {k: PARAMETERS[k][0] for k in chosen}
        tools.append({"type": "function", "function": {
            "name": name, "description": f"{name.replace('_', ' ').capitalize()}.",
            "parameters": {"type": "object", "properties": props, "required": chosen[:rng.randint(1, 2)]}}})
    return tools


def specs(seed: int) -> dict[str, ReplySpec]:
    """The three requests: 20 tools required, the same tools auto, a JSON response."""
    tools = parse_tools(declaration(seed))
    return {"tools required": ReplySpec("think", tools, parse_tool_choice("required", tools)),
            "tools auto": ReplySpec("think", tools, parse_tool_choice("auto", tools)),
            "json schema": ReplySpec("think", response=JsonSchema(gs.JSON_SCHEMA))}


def _call(rng: random.Random, lexicon: list[str], tool: Tool, index: int) -> str:
    required, parts = set(tool.required()), []
    for key, schema in tool.properties().items():
        if key in required or rng.random() < 0.6:
            value = PARAMETERS[key][1](rng, lexicon)
            text = value if schema["type"] == "string" else dumps(value)
            parts.append(xtml.opening(xtml.ARGUMENT, key=key, type=XTML_TYPE[schema["type"]]) + text
                         + xtml.closing(xtml.ARGUMENT))
    return xtml.opening(xtml.CALL, tool=tool.name, index=str(index)) + "".join(parts) + xtml.closing(xtml.CALL)


def tools_section(rng: random.Random, lexicon: list[str], tools: list[Tool]) -> str:
    calls = [_call(rng, lexicon, rng.choice(tools), i) for i in range(1, rng.randint(1, 3) + 1)]
    return xtml.opening(xtml.TOOLS) + "".join(calls) + xtml.closing(xtml.TOOLS)


def reply(rng: random.Random, lexicon: list[str], spec: ReplySpec) -> list[tuple[str, str]]:
    """A valid reply to `spec` as (section, text) pieces (the module's docstring)."""
    pieces = [("think", words(rng, lexicon, rng.randint(60, 160)))]
    opened = xtml.closing(xtml.THINK) + xtml.opening(xtml.RESPONSE)
    if isinstance(spec.response, JsonSchema):
        pieces += [("response", opened), ("json", gs.json_text(rng, lexicon)),
                   ("end", xtml.closing(xtml.RESPONSE) + xtml.closing(xtml.MESSAGE) + xtml.END_OF_MSG)]
        return pieces
    content = words(rng, lexicon, rng.randint(10, 40)) if spec.choice.mode == "auto" else ""
    pieces += [("response", opened + content + xtml.closing(xtml.RESPONSE)),
               ("tools", tools_section(rng, lexicon, list(spec.tools))),
               ("end", xtml.closing(xtml.MESSAGE) + xtml.END_OF_MSG)]
    return pieces


def check_calls(calls: list, tools: list[Tool]) -> str | None:
    """Why parsed tool calls do not hold to the declaration (None: they do)."""
    by_name = {t.name: t for t in tools}
    for call in calls:
        tool = by_name.get(call.name)
        if tool is None:
            return f"undeclared tool {call.name!r}"
        err = gs.schema_error(json.loads(call.arguments), dict(tool.parameters))
        if err:
            return f"{call.name}: {err}"
    return None
