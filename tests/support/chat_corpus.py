"""Seeded random chat requests for the chat template's parity tests: what OpenAI-style clients
send an agent's model, and K3's extensions of it.

Each case holds a conversation (system and user turns, assistant turns with reasoning, content and
tool calls, tool results), the template variables (tools, thinking, thinking_effort, tool_choice,
response_format, response_schema, add_generation_prompt) and the media blocks of its image parts,
in the order they are rendered.

The strings are the ones that break templates: CJK, emoji, quotes, `&`, backslashes, newlines,
marker-like text (`<|close|>message<|sep|>`); keys are mixed-case (so that a case-insensitive sort
shows); tool results come by id in and out of order, by `tool` or `name`, by position, and mixed.
Floats are those that print the same in Python and in C++'s default stream format (no integral
floats: Python writes 2.0, C++ 2), so that a case can also go to llama.cpp's C++ engine.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_graph_spec.vision import prompt
from ggml_graph_spec.vision.preprocess import MediaItem

KEYS = ("city", "City", "cITY", "unit", "Unit", "_private", "数量", "ключ", "emoji😀", "a b", "Zeta", "alpha",
        "Alpha", "a&b", 'q"uote', "0", "10", "9")
TEXTS = ("plain words", "天气怎么样？北京", "emoji 🌦️🎉👩‍💻", 'quotes "double" and \'single\'', "amp & amp; &amp;",
         "<|close|>message<|sep|><|end_of_msg|> fake", "<|open|>tools<|sep|>", "new\nline\ttab", "back\\slash \\n",
         "  spaced  ", "ünïcödé ß", "think response tools call", "x" * 40)
FLOATS = (0.5, -2.25, 0.125, 3.75)
NAMES = ("get_weather", "Search", "lookup_数据", "run&go", 'say"hi"', "calc")
EFFORTS = ("low", "high", "max", None)
# llama.cpp's template turns this placeholder into its next image prompt; a case with images never
# writes it as text (a case without images does: it is text there).
PLACEHOLDER = "<|kimi_image_placeholder|>"


@dataclass
class Case:
    messages: list[dict]
    kwargs: dict[str, Any] = field(default_factory=dict)
    image_blocks: list[str] = field(default_factory=list)


def media_block(width: int, height: int) -> str:
    """The block the runtime makes for an image of that original size (the one the built-in
    template must write for its image part)."""
    return prompt.media_block(MediaItem(np.zeros((1, 3, 1, 1), np.float32), (1, 1, 1), (width, height), "corpus"))


def _text(rng: random.Random) -> str:
    return rng.choice(TEXTS)


def _schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(("string", "integer", "number", "boolean", "enum", "array", "object")[:7 if depth else 5])
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(TEXTS, 2), "Description": _text(rng)}
    if kind == "array":
        return {"type": "array", "items": _schema(rng, depth - 1), "minItems": rng.randint(0, 2)}
    if kind == "object":
        return _object_schema(rng, depth - 1)
    out: dict[str, Any] = {"type": kind, "description": _text(rng)}
    if kind == "number":
        out["minimum"] = rng.choice(FLOATS)
    if kind == "boolean" and rng.random() < 0.5:
        out["default"] = rng.random() < 0.5
    return out


def _object_schema(rng: random.Random, depth: int) -> dict:
    keys = rng.sample(KEYS, rng.randint(0, 4))
    out = {"type": "object", "properties": {k: _schema(rng, depth) for k in keys}}
    if keys and rng.random() < 0.7:
        out["required"] = keys[: rng.randint(1, len(keys))]
    if rng.random() < 0.3:
        out["additionalProperties"] = False
    return out


def tool(rng: random.Random, name: str) -> dict:
    fn: dict[str, Any] = {"name": name, "parameters": _object_schema(rng, 2)}
    if rng.random() < 0.8:
        fn["description"] = _text(rng)
    if rng.random() < 0.2:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def value(rng: random.Random, depth: int = 2) -> Any:
    kind = rng.randrange(7 if depth else 5)
    if kind == 0:
        return _text(rng)
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.choice(FLOATS)
    if kind == 3:
        return rng.random() < 0.5
    if kind == 4:
        return None
    if kind == 5:
        return [value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {k: value(rng, depth - 1) for k in rng.sample(KEYS, rng.randint(0, 3))}


def _arguments(rng: random.Random, fn: dict) -> None:
    """A call's arguments in one of the shapes clients send: typed (a mapping), a JSON string, K3's
    raw json block, blank, or none at all."""
    args = {k: value(rng) for k in rng.sample(KEYS, rng.randint(0, 4))}
    r = rng.random()
    if r < 0.6:
        fn["arguments"] = args
    elif r < 0.8:
        fn["arguments"] = json.dumps(args, ensure_ascii=rng.random() < 0.5)
    elif r < 0.88:
        fn["_xtml_json_block"] = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
        fn["arguments"] = args
    elif r < 0.95:
        fn["arguments"] = rng.choice(("", "  ", None))


def tool_call(rng: random.Random, name: str, call_id: str) -> dict:
    fn: dict[str, Any] = {"name": name}
    _arguments(rng, fn)
    if rng.random() < 0.1:  # a call without OpenAI's function wrapper
        return fn
    return {"id": call_id, "type": "function", "function": fn}


def _result_content(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return [{"type": "text", "text": _text(rng)}, {"type": "text", "text": _text(rng)}]
    return _text(rng)


def tool_results(rng: random.Random, calls: list[dict]) -> list[dict]:
    """The tool messages after an assistant turn's calls, named in one of the ways clients name them."""
    names = [c.get("function", c)["name"] for c in calls]
    ids = [c.get("id") for c in calls]
    how = rng.choice(("id", "id", "id_shuffled", "id_key", "name", "tool", "position", "mixed", "extra"))
    order = list(range(len(calls)))
    if how in ("id_shuffled", "mixed", "name"):
        rng.shuffle(order)
    out = []
    for i in order:
        m: dict[str, Any] = {"role": "tool", "content": _result_content(rng)}
        pick = how if how != "mixed" else rng.choice(("id", "name", "position", "unknown_id"))
        if pick in ("id", "id_shuffled") and ids[i] is not None:
            m["tool_call_id"] = ids[i]
        elif pick == "id_key" and ids[i] is not None:
            m["id"] = ids[i]
        elif pick in ("name", "extra"):
            m["name"] = names[i]
        elif pick == "tool":
            m["tool"] = names[i] if rng.random() < 0.7 else None  # a `tool` key of null: by position,
            if m["tool"] is None and rng.random() < 0.7:  # even when the message has a name
                m["name"] = rng.choice(NAMES)
        elif pick == "unknown_id":
            m["tool_call_id"], m["name"] = "call_nowhere", names[i]
        out.append(m)
    if how == "extra":
        out.append({"role": "tool", "name": rng.choice(NAMES), "content": _text(rng)})
    return out


def _user_content(rng: random.Random, case: Case, images: bool) -> Any:
    if rng.random() < 0.6:
        text = _text(rng)
        return text if images or rng.random() < 0.9 else text + PLACEHOLDER
    parts = []
    for _ in range(rng.randint(1, 3)):
        if images and rng.random() < 0.4:
            w, h = rng.randint(1, 4000), rng.randint(1, 4000)
            parts.append({"type": "image", "width": w, "height": h})
            case.image_blocks.append(media_block(w, h))
        else:
            parts.append({"type": "text", "text": _text(rng)})
    return parts


def _assistant(rng: random.Random, calls: list[dict]) -> dict:
    m: dict[str, Any] = {"role": "assistant"}
    r = rng.random()
    if r < 0.5:
        m["reasoning_content"] = _text(rng)
    elif r < 0.6:
        m["reasoning"] = _text(rng)
    elif r < 0.7:
        m["reasoning_content"] = rng.choice(("", " \n ", None))
    content = rng.choice((_text(rng), "", None, [{"type": "text", "text": _text(rng)}]))
    if content is not None or not calls or rng.random() < 0.5:
        m["content"] = content
    if calls:
        m["tool_calls"] = calls
    if rng.random() < 0.1:
        m["name"] = rng.choice(NAMES)
    return m


def _named(rng: random.Random, m: dict) -> dict:
    if rng.random() < 0.15:
        m["name"] = rng.choice(('Ann & "Bo"', "助手", "bob"))
    return m


def _round(rng: random.Random, case: Case, tool_names: list[str], images: bool) -> None:
    """A user turn, then the assistant's answer, or its calls and their results (and perhaps a
    second assistant turn)."""
    case.messages.append(_named(rng, {"role": "user", "content": _user_content(rng, case, images)}))
    if not tool_names or rng.random() < 0.3:
        case.messages.append(_assistant(rng, []))
        return
    calls = [tool_call(rng, rng.choice(tool_names), f"call_{len(case.messages)}_{i}")
             for i in range(rng.randint(1, 3))]
    case.messages.append(_assistant(rng, calls))
    case.messages += tool_results(rng, calls)
    if rng.random() < 0.6:
        case.messages.append(_assistant(rng, []))


def _response_format(rng: random.Random, kwargs: dict) -> None:
    r = rng.random()
    schema = _object_schema(rng, 2)
    if r < 0.15:
        kwargs["response_format"] = {"type": "json_object"}
    elif r < 0.25:
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "Reply", "schema": schema}}
    elif r < 0.3:
        kwargs["response_format"] = {"type": "json_schema", "json_schema": schema}  # the schema, unwrapped
    elif r < 0.35:
        kwargs["response_format"] = {"type": "text"}
    if r < 0.35 and rng.random() < 0.1:
        kwargs["response_schema"] = _object_schema(rng, 1)


def _settings(rng: random.Random, tools: list[dict]) -> dict:
    kwargs: dict[str, Any] = {"add_generation_prompt": rng.random() < 0.7}
    if tools or rng.random() < 0.1:
        kwargs["tools"] = tools
    for name, choices in (("thinking", (True, False)), ("thinking_effort", EFFORTS),
                          ("tool_choice", ("auto", "required", "none"))):
        if rng.random() < 0.6:
            kwargs[name] = rng.choice(choices)
    _response_format(rng, kwargs)
    return kwargs


def case(rng: random.Random) -> Case:
    """One seeded request: a conversation and its template variables."""
    names = rng.sample(NAMES, rng.randint(0, 3))
    tools = [tool(rng, n) for n in names]
    c = Case([], _settings(rng, tools))
    images = rng.random() < 0.3
    if rng.random() < 0.6:
        c.messages.append(_named(rng, {"role": "system", "content": _text(rng)}))
    for i in range(rng.randint(1, 4)):
        if i and rng.random() < 0.1:  # tools loaded lazily, mid-conversation
            lazy = rng.choice([n for n in NAMES if n not in names])
            names.append(lazy)
            c.messages.append({"role": "system", "tools": [tool(rng, lazy)]})
        _round(rng, c, names, images)
    if rng.random() < 0.2:
        c.messages.pop()  # end on a tool result or an assistant's calls
    return c


def corpus(seed: int, n: int) -> list[Case]:
    rng = random.Random(seed)
    return [case(rng) for _ in range(n)]
