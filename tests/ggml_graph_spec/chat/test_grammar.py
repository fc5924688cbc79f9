"""The grammars hold what the API promises: a call names a declared tool, has every required
argument once, each typed as the schema says, and nothing else; a JSON response follows its schema;
the markers match only their special tokens."""
from __future__ import annotations

import pytest

from gguf_arch.arch.xtml import closing, opening
from ggml_graph_spec.chat.constraint import GrammarError, compile_grammar
from ggml_graph_spec.chat.grammar import JsonSchema, Lark, ReplySpec, closed_objects, reply_grammar, tools_grammar
from ggml_graph_spec.chat.tools import parse_tool_choice, parse_tools

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "days"]}}}])


def arg(key, kind, value):
    return opening("argument", key=key, type=kind) + value + closing("argument")


def call(*args, name="get_weather", index=1):
    return opening("call", tool=name, index=str(index)) + "".join(args) + closing("call")


END = closing("message") + "<|end_of_msg|>"


def accepts(tok, grammar: str, text: str, *, special: bool = True) -> bool:
    m = compile_grammar(tok, grammar, "test")
    ids = tok.encode(text, add_bos=False, allow_special=special)
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


def required(tools=TOOLS, **kw):
    return reply_grammar(ReplySpec("think", tools, parse_tool_choice("required", tools, **kw)))


def reply(calls: str, thought: str = "hm", content: str = "") -> str:
    return (thought + closing("think") + opening("response") + content + closing("response") + opening("tools")
            + calls + closing("tools") + END)


GOOD = call(arg("city", "string", "Paris"), arg("days", "number", "3"))


def test_a_valid_call_is_accepted_in_the_order_the_schema_lists_its_properties(tok):
    assert accepts(tok, required(), reply(GOOD))
    assert accepts(tok, required(), reply(call(arg("city", "string", "Oslo"), arg("days", "number", "1"),
                                               arg("unit", "string", "f"))))


@pytest.mark.parametrize("calls", [
    call(arg("city", "string", "Paris")),  # a required argument missing
    call(arg("city", "string", "Paris"), arg("days", "number", "three")),  # not an integer
    call(arg("city", "string", "Paris"), arg("days", "string", "3")),  # the wrong type attribute
    call(arg("city", "string", "Paris"), arg("days", "number", "3"), arg("unit", "string", "k")),  # not in enum
    call(arg("city", "string", "Paris"), arg("days", "number", "3"), arg("extra", "string", "x")),  # undeclared
    call(arg("city", "string", "A very long city name"), arg("days", "number", "3")),  # maxLength
    call(arg("city", "string", "Paris"), arg("days", "number", "3"), name="get_time"),  # undeclared tool
])
def test_an_invalid_call_is_refused(tok, calls):
    assert not accepts(tok, required(), reply(calls))


def test_required_calls_come_with_an_empty_response_and_at_least_one_call(tok):
    assert not accepts(tok, required(), reply(GOOD, content="Sure."))
    no_call = "hm" + closing("think") + opening("response") + closing("response") + END
    assert not accepts(tok, required(), no_call)


def test_parallel_calls_only_when_allowed(tok):
    two = GOOD + call(arg("city", "string", "Rome"), arg("days", "number", "2"), index=2)
    assert accepts(tok, required(), reply(two))
    assert not accepts(tok, required(parallel=False), reply(two)) and accepts(tok, required(parallel=False), reply(GOOD))


def test_markers_spelled_as_text_are_not_markers(tok):
    assert not accepts(tok, required(), reply(GOOD), special=False)


def test_the_lazy_tools_grammar_starts_after_its_marker(tok):
    g = tools_grammar(TOOLS, parse_tool_choice("auto", TOOLS))
    text = opening("tools") + GOOD + closing("tools") + END
    assert accepts(tok, g, text[len("<|open|>"):]) and not accepts(tok, g, text)


def test_a_json_response_follows_its_schema_and_objects_are_closed_to_their_properties(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = reply_grammar(ReplySpec("response", response=JsonSchema(schema)))
    ok = '{"a": 1}' + closing("response") + END
    assert accepts(tok, g, ok) and not accepts(tok, g, '{"a": "x"}' + closing("response") + END)
    assert not accepts(tok, g, '{"a": 1, "b": 2}' + closing("response") + END)
    assert closed_objects({"properties": {}, "additionalProperties": True}) == {"properties": {},
                                                                                "additionalProperties": True}


def test_a_grammar_of_the_callers_own_holds_the_response(tok):
    g = reply_grammar(ReplySpec("response", response=Lark('start: "yes" | "no"')))
    assert accepts(tok, g, "yes" + closing("response") + END) and not accepts(tok, g, "maybe" + closing("response") + END)


def test_a_grammar_that_cannot_compile_is_refused_by_name(tok):
    with pytest.raises(GrammarError, match="grammar"):
        compile_grammar(tok, reply_grammar(ReplySpec("response", response=Lark("start: undefined_rule"))), "grammar")
