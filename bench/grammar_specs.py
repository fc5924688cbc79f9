"""The grammars of bench/grammar_libs.py, texts that follow them, and checks of an output.

Three grammars, each in the form both libraries compile:

  json    a JSON schema (nested: objects in an array, enums, required fields, a string pattern),
          given to each library's JSON-schema compiler;
  tools   a 20-tool declaration in K3's XTML tool-call form, as Lark: `<|open|>tools<|sep|>`, one or
          more `<|open|>call tool="NAME" index="N"<|sep|>` with one `argument` element per argument
          (a string-typed value raw, any other as JSON) and `<|close|>call<|sep|>`, then
          `<|close|>tools<|sep|>`; the markers are special tokens (`<|open|>` in Lark names the
          token, never the text), the tag names ordinary text;
  think   free text, then the special-token terminator `<|close|>think<|sep|>`.

Both libraries read the same Lark text (llguidance's dialect and xgrammar's meet on it: markers as
`<|name|>`, `%json {...}` for a JSON value, `[\\s\\S]*` for any text). xgrammar is also given its own
way of writing K3 (structural tags with markers as strings and their text excluded from free
text), the way its built-in `kimi_k3` tag writes them.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
MARKERS = (OPEN, CLOSE, SEP)
TEXT_RULE = r"TEXT: /[\s\S]*/"
TEXT = "TEXT"  # any text, as a regex: the library decides whether a special token can be part of it


def token_text(first_special: int, last_special: int) -> str:
    """Any text as a run of tokens other than the special ones, named by id (both dialects)."""
    return f"<[^{first_special}-{last_special}]>*"

JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["open", "shipped", "cancelled"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"}, "vip": {"type": "boolean"}},
            "required": ["name"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"},
                "kind": {"enum": ["book", "tool", "food"]},
                "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number"},
                "note": {"type": ["string", "null"]}},
            "required": ["sku", "kind", "qty"], "additionalProperties": False}},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["id", "status", "items"],
    "additionalProperties": False,
}

TOOL_NAMES = ["get_weather", "search_files", "read_file", "write_file", "run_command", "send_email",
              "create_event", "list_events", "translate_text", "convert_units", "lookup_stock", "book_table",
              "query_database", "fetch_url", "resize_image", "set_reminder", "get_route", "compute_hash",
              "summarize_text", "create_ticket"]
# Argument schemas the tools draw from: K3 writes a string-typed value raw, any other as JSON.
PARAMETERS = [
    ("query", {"type": "string"}), ("path", {"type": "string", "pattern": "^/[a-z0-9_/]{1,40}$"}),
    ("unit", {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]}),
    ("limit", {"type": "integer", "minimum": 1, "maximum": 100}), ("ratio", {"type": "number"}),
    ("recursive", {"type": "boolean"}), ("labels", {"type": "array", "items": {"type": "string"}, "maxItems": 4}),
    ("window", {"type": "object", "properties": {"start": {"type": "integer"}, "end": {"type": "integer"}},
                "required": ["start", "end"], "additionalProperties": False}),
    ("body", {"type": "string"}), ("mode", {"type": "string", "enum": ["fast", "exact"]}),
]


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # a JSON schema of type object, properties in the order they are written


def make_tools(seed: int) -> list[Tool]:
    """The 20 tools: each 2-5 of PARAMETERS in their order, the first one or two required."""
    rng = random.Random(seed)
    tools = []
    for name in TOOL_NAMES:
        chosen = sorted(rng.sample(range(len(PARAMETERS)), rng.randint(2, 5)))
        props = {PARAMETERS[i][0]: PARAMETERS[i][1] for i in chosen}
        required = list(props)[:rng.randint(1, 2)]
        tools.append(Tool(name, {"type": "object", "properties": props, "required": required,
                                 "additionalProperties": False}))
    return tools


def k3_type(schema: dict) -> str:
    """The `type="T"` K3 writes for a value of this schema (integers are numbers)."""
    t = schema.get("type", "string")
    return "number" if t == "integer" else t


# ---- Lark (both libraries) -----------------------------------------------------------------------

def _lark_string(text: str) -> str:
    return json.dumps(text)


def _argument_rule(rule: str, key: str, schema: dict, text: str) -> str:
    head = _lark_string(f'argument key="{key}" type="{k3_type(schema)}"')
    if schema.get("type") != "string":
        value = "%json " + json.dumps(schema)
    elif "enum" in schema:
        value = "(" + " | ".join(_lark_string(v) for v in schema["enum"]) + ")"
    elif "pattern" in schema:
        value = "/" + schema["pattern"].strip("^$").replace("/", "\\/") + "/"
    else:
        value = text
    return f"{rule}: {OPEN} {head} {SEP} {value} {CLOSE} \"argument\" {SEP}"


def tools_lark(tools: list[Tool], text: str = TEXT) -> str:
    lines = [f'start: {OPEN} "tools" {SEP} call+ {CLOSE} "tools" {SEP}',
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        args = []
        for j, (key, schema) in enumerate(tool.parameters["properties"].items()):
            lines.append(_argument_rule(f"arg_{i}_{j}", key, schema, text))
            args.append(f"arg_{i}_{j}" + ("" if key in tool.parameters["required"] else "?"))
        head = _lark_string(f'call tool="{tool.name}" index="')
        lines.append(f'call_{i}: {OPEN} {head} INDEX "\\"" {SEP} {" ".join(args)} {CLOSE} "call" {SEP}')
    lines += ["INDEX: /[1-9][0-9]{0,2}/", TEXT_RULE]
    return "\n".join(lines) + "\n"


def think_lark(text: str = TEXT) -> str:
    return f'start: {text} {CLOSE} "think" {SEP}\n{TEXT_RULE}\n'


def lark_grammars(tools: list[Tool], first_special: int, last_special: int) -> dict[str, str]:
    """The Lark both libraries compile: raw text as a regex, and as a run of non-special tokens."""
    tokens = token_text(first_special, last_special)
    return {"tools": tools_lark(tools), "think": think_lark(),
            "tools (token text)": tools_lark(tools, tokens), "think (token text)": think_lark(tokens)}


# ---- texts that follow the grammars (the walks of valid sequences) --------------------------------

def _words(rng: random.Random, lexicon: list[str], n: int) -> str:
    out = []
    for _ in range(n):
        w = rng.choice(lexicon)
        out.append(w.capitalize() if rng.random() < 0.1 else w)
        if rng.random() < 0.08:
            out[-1] += rng.choice([",", ".", ";", ":", "?", "!"]) + ("\n" if rng.random() < 0.2 else "")
    return " ".join(out)


def json_text(rng: random.Random, lexicon: list[str]) -> str:
    def item() -> dict:
        return {"sku": "".join(rng.choice("abcdefgh") for _ in range(2)) + f"{rng.randint(0, 999):03d}",
                "kind": rng.choice(["book", "tool", "food"]), "qty": rng.randint(1, 40),
                "price": round(rng.uniform(0, 500), 2), "note": _words(rng, lexicon, rng.randint(2, 12))}
    value = {"id": "".join(rng.choice("ABCDEFGHIJ") for _ in range(3)) + f"-{rng.randint(0, 9999):04d}",
             "status": rng.choice(["open", "shipped", "cancelled"]), "priority": rng.randint(1, 5),
             "customer": {"name": _words(rng, lexicon, 2), "email": rng.choice(lexicon) + "@example.org",
                          "vip": rng.random() < 0.5},
             "items": [item() for _ in range(rng.randint(1, 4))],
             "tags": [rng.choice(lexicon) for _ in range(rng.randint(0, 3))]}
    return json.dumps(value, ensure_ascii=False, indent=rng.choice([None, 2]))


def _value(rng: random.Random, lexicon: list[str], schema: dict) -> object:
    t = schema.get("type")
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if t == "string":
        return "/" + "/".join(rng.choice(lexicon)[:8] for _ in range(rng.randint(1, 3))) if "pattern" in schema \
            else _words(rng, lexicon, rng.randint(1, 30))
    if t == "integer":
        return rng.randint(schema.get("minimum", 0), schema.get("maximum", 1000))
    if t == "number":
        return round(rng.uniform(-100, 100), 3)
    if t == "boolean":
        return rng.random() < 0.5
    if t == "array":
        return [rng.choice(lexicon) for _ in range(rng.randint(0, schema.get("maxItems", 4)))]
    return {"start": rng.randint(0, 50), "end": rng.randint(50, 100)}


def tools_text(rng: random.Random, lexicon: list[str], tools: list[Tool]) -> str:
    calls = []
    for index in range(1, rng.randint(1, 3) + 1):
        tool = rng.choice(tools)
        args = []
        for key, schema in tool.parameters["properties"].items():
            if key in tool.parameters["required"] or rng.random() < 0.6:
                v = _value(rng, lexicon, schema)
                body = v if isinstance(v, str) else json.dumps(v)
                args.append(f'{OPEN}argument key="{key}" type="{k3_type(schema)}"{SEP}{body}{CLOSE}argument{SEP}')
        calls.append(f'{OPEN}call tool="{tool.name}" index="{index}"{SEP}{"".join(args)}{CLOSE}call{SEP}')
    return f"{OPEN}tools{SEP}{''.join(calls)}{CLOSE}tools{SEP}"


def think_text(rng: random.Random, lexicon: list[str]) -> str:
    return _words(rng, lexicon, rng.randint(80, 240)) + f"{CLOSE}think{SEP}"


# ---- checks of an output (the seeded random walks) -------------------------------------------------

try:
    import jsonschema
except ImportError:  # the checks below fall back to json.loads and the top-level required keys
    jsonschema = None


def schema_error(value: object, schema: dict) -> str | None:
    """Why `value` does not follow `schema`, or None."""
    if jsonschema is None:
        missing = [k for k in schema.get("required", []) if not isinstance(value, dict) or k not in value]
        return f"missing {missing}" if missing else None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return e.message[:120]
    return None


def segments(tokens: list[int], tokenizer, markers: dict[int, str]) -> list[str | bytes]:
    """The output as marker names (str) and the bytes between them; any other special token is
    kept as its name too, so that the checks below find it where it does not belong."""
    out: list[str | bytes] = []
    for t in tokens:
        if tokenizer.is_special(t):
            out.append(markers.get(t, tokenizer.token_bytes(t).decode()))
        elif out and isinstance(out[-1], bytes):
            out[-1] += tokenizer.token_bytes(t)
        else:
            out.append(tokenizer.token_bytes(t))
    return out


def _text(seg: str | bytes, what: str) -> str:
    if not isinstance(seg, bytes):
        raise ValueError(f"special token {seg} in {what}")
    try:
        return seg.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"invalid UTF-8 in {what}") from None


def check_json(segs: list[str | bytes]) -> str | None:
    if len(segs) != 1:
        return "special token in the JSON" if segs else "empty output"
    try:
        value = json.loads(_text(segs[0], "the JSON"))  # strict: a raw control character in a string fails
    except ValueError as e:
        return f"not JSON: {str(e)[:80]}"
    return schema_error(value, JSON_SCHEMA)


class _Reader:
    """XTML read from segments: markers, then tag text."""

    def __init__(self, segs: list[str | bytes]) -> None:
        self.segs, self.i = segs, 0

    def peek(self) -> str | bytes | None:
        return self.segs[self.i] if self.i < len(self.segs) else None

    def take(self, what: str) -> str | bytes:
        seg = self.peek()
        if seg is None:
            raise ValueError(f"output ends before {what}")
        self.i += 1
        return seg

    def marker(self, name: str) -> None:
        seg = self.take(name)
        if seg != name:
            raise ValueError(f"expected {name}, got {seg[:40]!r}")

    def element(self, opener: str, pattern: str) -> re.Match:
        """A marker, then tag text matching `pattern`, then <|sep|>."""
        self.marker(opener)
        text = _text(self.take("a tag"), "a tag")
        m = re.fullmatch(pattern, text)
        if not m:
            raise ValueError(f"tag {text[:60]!r} is not {pattern}")
        self.marker(SEP)
        return m

    def value(self) -> str:
        """The bytes up to the next marker (none: the empty value)."""
        return "" if not isinstance(self.peek(), bytes) else _text(self.take("a value"), "a value")


def _argument(r: _Reader, tool: Tool, seen: set[str]) -> None:
    m = r.element(OPEN, r'argument key="([^"]*)" type="([a-z]+)"')
    key, typ = m.group(1), m.group(2)
    props = tool.parameters["properties"]
    if key not in props or key in seen:
        raise ValueError(f"argument {key!r} unknown or repeated for {tool.name}")
    seen.add(key)
    if typ != k3_type(props[key]):
        raise ValueError(f"argument {key} written as type {typ}")
    raw = r.value()
    try:
        value = raw if typ == "string" else json.loads(raw)
    except ValueError:
        raise ValueError(f"argument {key}: {raw[:40]!r} is not JSON") from None
    err = schema_error(value, props[key])
    if err:
        raise ValueError(f"argument {key}: {err}")
    r.element(CLOSE, "argument")


def _call(r: _Reader, tools: dict[str, Tool]) -> None:
    m = r.element(OPEN, r'call tool="([^"]*)" index="([1-9][0-9]*)"')
    tool = tools.get(m.group(1))
    if tool is None:
        raise ValueError(f"unknown tool {m.group(1)!r}")
    seen: set[str] = set()
    while r.peek() == OPEN:
        _argument(r, tool, seen)
    missing = set(tool.parameters["required"]) - seen
    if missing:
        raise ValueError(f"{tool.name}: required {sorted(missing)} missing")
    r.element(CLOSE, "call")


def check_tools(segs: list[str | bytes], tools: list[Tool]) -> str | None:
    r = _Reader(segs)
    try:
        r.element(OPEN, "tools")
        by_name = {t.name: t for t in tools}
        _call(r, by_name)
        while r.peek() == OPEN:
            _call(r, by_name)
        r.element(CLOSE, "tools")
        if r.peek() is not None:
            raise ValueError("output goes on after the tools element")
    except ValueError as e:
        return str(e)
    return None


def check_think(segs: list[str | bytes]) -> str | None:
    """Text, then <|close|>think<|sep|>: a special token before that is in the body."""
    if segs[-3:] != [CLOSE, b"think", SEP]:
        if segs and isinstance(segs[-1], bytes) and segs[-1].endswith(SEP.encode()):
            return "the terminator's <|sep|> spelled as text"
        return f"does not end with {CLOSE}think{SEP}: {segs[-3:]!r}"[:160]
    for seg in segs[:-3]:
        if isinstance(seg, str):
            return f"special token {seg} in the think body"
    try:
        _text(b"".join(segs[:-3]), "the think body")
    except ValueError as e:
        return str(e)
    return None
