"""The reply parser: K3's channels and tool calls out of a token stream, as llama.cpp's K3 parser
reads them (common/parsers/kimi-k3.cpp), streamed pieces adding up to the whole reply, every
documented fault with its one outcome."""
from __future__ import annotations

import json

import pytest

from gguf_arch.arch.xtml import closing, opening
from ggml_graph_spec.chat.reply import ReplyParser
from ggml_graph_spec.chat.tools import parse_tools

TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": 'say "hi" & <go>', "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}},
])


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_bos=False)


def _call(name: str, args: list[tuple[str, str, str]], index: int = 1) -> str:
    body = "".join(opening("argument", key=k, type=t) + v + closing("argument") for k, t, v in args)
    return opening("call", tool=name, index=str(index)) + body + closing("call")


def _tools(*calls: str) -> str:
    return opening("tools") + "".join(calls) + closing("tools")


def _parse(tok, text: str, start: str = "think", tools=TOOLS, **kw):
    p = ReplyParser(tok, start, tools, new_id=iter(f"call_{i}" for i in range(99)).__next__, **kw)
    shown, deltas = [], []
    for t in _ids(tok, text):
        if p.feed(t):
            shown.append(t)
        deltas += p.take()
    reply = p.finish()
    return reply, deltas + p.take(), tok.decode(shown)


def _end() -> str:
    return closing("message") + "<|end_of_msg|>"


def test_channels_go_apart_and_markup_never_reaches_content(tok):
    text = ("I think about <think> tags" + closing("think") + opening("response") + "The answer is 4."
            + closing("response") + _end())
    reply, deltas, shown = _parse(tok, text)
    assert reply.reasoning == "I think about <think> tags" and reply.content == "The answer is 4."
    assert shown == reply.content and not reply.tool_calls and not reply.error
    assert "".join(d.text for d in deltas if d.kind == "reasoning") == reply.reasoning


def test_reasoning_ends_at_the_response_opener_without_its_closer_and_a_cut_reply_still_parses(tok):
    reply, _, _ = _parse(tok, "pondering" + opening("response") + "half an answ")
    assert (reply.reasoning, reply.content) == ("pondering", "half an answ")


def test_tool_calls_are_typed_by_the_tools_schema_not_by_the_written_type(tok):
    # days is an integer in the schema: its text is JSON; city is a string: its text is raw, even
    # where the model wrote type="number"; the call's arguments are one JSON object.
    call = _call("get_weather", [("city", "number", 'Paris "Nord"\n'), ("days", "string", " 3 "),
                                 ("opts", "object", '{"units": "c"}')])
    text = closing("think") + opening("response") + closing("response") + _tools(call) + _end()
    reply, deltas, shown = _parse(tok, text)
    (c,) = reply.tool_calls
    assert c.name == "get_weather" and json.loads(c.arguments) == {"city": 'Paris "Nord"\n', "days": 3,
                                                                  "opts": {"units": "c"}}
    pieces = "".join(d.text for d in deltas if d.kind == "arguments")
    assert pieces == c.arguments and [d.id for d in deltas if d.kind == "call"] == [c.id]
    assert shown == "" and reply.content == ""


def test_parallel_calls_and_an_escaped_tool_name(tok):
    name = 'say "hi" & <go>'
    text = (closing("think") + opening("response") + "Calling." + _tools(_call(name, [("text", "string", "a")]),
            _call("get_weather", [("city", "string", "b")], 2)) + _end())
    reply, _, shown = _parse(tok, text)
    assert [c.name for c in reply.tool_calls] == [name, "get_weather"] and shown == "Calling."
    assert [json.loads(c.arguments) for c in reply.tool_calls] == [{"text": "a"}, {"city": "b"}]


def test_a_json_block_call_and_marker_text_inside_an_argument(tok):
    # "<|close|>" written as ordinary text tokens inside an argument is text, not markup
    text_tokens = tok.encode("<|close|>", add_bos=False, allow_special=False)
    p = ReplyParser(tok, "response", TOOLS)
    ids = _ids(tok, closing("response") + opening("tools") + opening("call", tool="get_weather", index="1")
               + opening("argument", key="city", type="string"))
    ids += text_tokens + _ids(tok, closing("argument") + closing("call") + opening("call", tool="get_weather",
                                                                                  index="2") + opening("json", type="object")
                              + '{"city": "y"}' + closing("json") + closing("call") + closing("tools") + _end())
    for t in ids:
        p.feed(t)
    reply = p.finish()
    assert [json.loads(c.arguments) for c in reply.tool_calls] == [{"city": "<|close|>"}, {"city": "y"}]


@pytest.mark.parametrize("section, why", [
    (_call("undeclared", [("a", "string", "b")]), "does not declare"),
    (_call("get_weather", [("days", "number", "three")]), "is not JSON"),
    (opening("call", tool="get_weather", index="1") + opening("json", type="object") + "[1]" + closing("json"),
     "not a JSON object"),
    (opening("call", tool="get_weather", index="1") + opening("bogus") + closing("call"), "inside the tools section"),
])
def test_a_fault_ends_the_tools_section_keeps_what_came_before_and_says_why(tok, section, why):
    good = _call("get_weather", [("city", "string", "ok")])
    text = closing("think") + opening("response") + closing("response") + _tools(good, section) + _end()
    reply, _, shown = _parse(tok, text)
    assert why in reply.error and reply.tool_calls[0].name == "get_weather" and shown == ""
    assert json.loads(reply.tool_calls[0].arguments) == {"city": "ok"}
    assert all(c.name != "undeclared" for c in reply.tool_calls)


def test_a_call_cut_short_is_reported_open(tok):
    text = (closing("think") + opening("response") + closing("response") + opening("tools")
            + opening("call", tool="get_weather", index="1") + opening("argument", key="city", type="string") + "Par")
    reply, deltas, _ = _parse(tok, text)
    assert reply.open_call and reply.tool_calls[0].arguments == '{"city":"Par'


def test_reasoning_in_content_counts_the_think_text_as_reply_text(tok):
    text = "hmm" + closing("think") + opening("response") + "yes" + closing("response") + _end()
    reply, _, shown = _parse(tok, text, reasoning_in_content=True)
    assert shown == "hmmyes" and (reply.reasoning, reply.content) == ("hmm", "yes")


def test_a_template_that_is_not_k3s_gives_everything_as_content(tok):
    reply, _, shown = _parse(tok, "plain text " + closing("think") + "more", start="text")
    assert shown == reply.content == "plain text more" and reply.reasoning == ""
