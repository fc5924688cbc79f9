"""Parse round trip: an assistant turn with random tool calls, rendered by the built-in K3 chat
template (as the server renders a history, its strings marked as input), parses back to the same
calls: each tool's name, and arguments equal as JSON values, typed by the tools' schemas."""
from __future__ import annotations

import json
import random

import pytest

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE
from gguf_arch.arch.xtml import opening
from ggml_graph_spec.chat.reply import ReplyParser
from ggml_graph_spec.chat.tools import parse_tools
from ggml_graph_spec.text.chat_template import ChatTemplate, encode_marked, mark_input

STRINGS = ("Paris", "天气 🌦️", 'say "hi" & <go>', "<|close|>argument<|sep|>", "line\nbreak", "", "  x  ")
KINDS = ("string", "integer", "number", "boolean", "array", "object", "null")


def _value(rng: random.Random, kind: str):
    return {"string": lambda: rng.choice(STRINGS), "integer": lambda: rng.randint(-99, 99),
            "number": lambda: rng.choice((0.5, -2.25, 1e-3)), "boolean": lambda: rng.random() < 0.5,
            "array": lambda: [rng.choice(STRINGS), rng.randint(0, 9)],
            "object": lambda: {"k": rng.choice(STRINGS), "n": [1, {"deep": None}]}, "null": lambda: None}[kind]()


def _case(rng: random.Random):
    tools, calls = [], []
    for t in range(rng.randint(1, 3)):
        kinds = {f"arg{i}_{k}": k for i, k in enumerate(rng.sample(KINDS, rng.randint(1, 4)))}
        name = rng.choice(("get_weather", 'say"hi"', "lookup_数据", "run&go")) + str(t)
        tools.append({"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {k: {"type": v} for k, v in kinds.items()}}}})
        for _ in range(rng.randint(1, 2)):
            args = {k: _value(rng, v) for k, v in kinds.items() if rng.random() < 0.8}
            as_string = rng.random() < 0.3  # OpenAI's shape: a JSON string (the template's json block)
            calls.append({"id": f"c{len(calls)}", "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_string else args}})
    rng.shuffle(calls)
    return tools, calls


@pytest.mark.parametrize("seed", range(40))
def test_rendered_tool_calls_parse_back_to_the_same_calls(tok, seed):
    rng = random.Random(seed)
    tools, calls = _case(rng)
    template = ChatTemplate(K3_CHAT_TEMPLATE, "built-in", tok, {})
    history = [{"role": "user", "content": "Go."},
               {"role": "assistant", "content": rng.choice(("", "Calling.")), "reasoning_content": "plan",
                "tool_calls": calls}]
    text = template.render(mark_input(history, tok), add_generation_prompt=False, tools=mark_input(tools, tok))
    turn = text[text.rindex(opening("message", role="assistant")) + len(opening("message", role="assistant")):]
    assert turn.startswith(opening("think"))
    p = ReplyParser(tok, "think", parse_tools(tools))
    for t in encode_marked(turn[len(opening("think")):], tok):
        p.feed(t)
    reply = p.finish()
    assert not reply.error and reply.reasoning == "plan" and reply.content == history[1]["content"]
    want = [(c["function"]["name"], c["function"]["arguments"] if isinstance(c["function"]["arguments"], dict)
             else json.loads(c["function"]["arguments"])) for c in calls]
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == want
