"""The built-in K3 template renders K3's agent format byte for byte as llama.cpp's own K3 template
(the format's public statement) does, on a seeded corpus of agent conversations
(tests/support/chat_corpus.py), and differs from it only where docs/reference/chat-format.md says
it does on purpose.

llama.cpp's template is read at test time from the tools build (tests/interop/llama_tools.py:
a failure under CI=true when it is missing, a skip otherwise). Both templates render in the
project's sandbox (gguf_arch/arch/template_sandbox.py); tests/interop/test_chat_template_llama_server.py
checks ours in llama.cpp's own C++ engine.
"""
from __future__ import annotations

import pytest

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE
from gguf_arch.arch.template_sandbox import BoundedSandbox, compile_template, render
from gguf_arch.errors import KimiError

from tests.interop.llama_tools import llama_k3_template
from tests.support.chat_corpus import Case, corpus

SEED, N_CASES = 20261207, 200


class CppEngineSandbox(BoundedSandbox):
    """The sandbox with dictsort as llama.cpp's C++ engine runs it: case-sensitive whatever the
    arguments say (common/jinja/value.cpp, dictsort: "sorting is currently always case
    sensitive"). llama.cpp's template calls a bare `dictsort`, which Jinja2 sorts case-insensitively
    ("alpha" before "City"); in llama.cpp, and in Moonshot's json.dumps(sort_keys=True), "City"
    comes first. Only llama.cpp's template renders here: ours asks for case_sensitive=true itself."""

    def __init__(self) -> None:
        super().__init__()
        real = self.filters["dictsort"]
        self.filters["dictsort"] = lambda value, case_sensitive=True, by="key", reverse=False: \
            real(value, True, by, reverse)


@pytest.fixture(scope="module")
def theirs():
    return CppEngineSandbox().from_string(llama_k3_template())


@pytest.fixture(scope="module")
def ours():
    return compile_template(K3_CHAT_TEMPLATE, "built-in K3 template")


def _theirs(template, case: Case) -> str:
    # Our image parts are K3's media blocks; llama.cpp's template writes its `image_prompts` for
    # them (the block the runtime made for each image), so both are given the same blocks.
    extra = {"image_prompts": case.image_blocks} if case.image_blocks else {}
    return template.render(messages=case.messages, **case.kwargs, **extra)


def _first_difference(a: str, b: str) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at {i}:\n ours:   {a[max(0, i - 120):i + 120]!r}\n theirs: {b[max(0, i - 120):i + 120]!r}"


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    return corpus(SEED, N_CASES)


@pytest.fixture(scope="module")
def rendered(ours, cases) -> list[str]:
    # Template.render, not the bounded render: its per-line watch would make these tests four
    # times slower, and the bounds are test_template_sandbox.py's subject (the sandbox's size
    # checks still apply).
    return [ours.render(messages=c.messages, **c.kwargs) for c in cases]


def test_the_corpus_renders_byte_for_byte_as_llama_cpps_template(rendered, theirs, cases):
    for i, (case, a) in enumerate(zip(cases, rendered)):
        b = _theirs(theirs, case)
        assert a == b, f"case {i} ({case.kwargs}) differs {_first_difference(a, b)}"


@pytest.mark.parametrize("needle, at_least", [
    ('type="tool-declare"', 100), ("## New Tools Available", 15), ('<|open|>json type="object"', 70),
    ("`tool_choice=required`", 20), ("`tool_choice=none`", 15), ("`response_format=json_object`", 20),
    ("`response_format=json_schema`", 12), ("<|media_begin|>image", 25), ('role="tool" tool=', 250),
    ('index="3"', 90), ("`thinking_effort=low`", 12), ('type="object"<|sep|>{', 100), ('type="null"', 45),
    ('role="user" name="', 40), ("<|kimi_image_placeholder|>", 10), ('"City"', 60),
])
def test_the_corpus_covers_the_format(rendered, needle, at_least):
    """The corpus is random: this says it holds what the parity test is meant to see."""
    text = "".join(rendered)
    assert text.count(needle) >= at_least, (needle, text.count(needle))


def test_results_come_in_the_calls_order_when_each_names_its_call(ours, theirs):
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": f"t{i}", "arguments": {}}} for i in (1, 2)]
    case = Case([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls},
                 {"role": "tool", "tool_call_id": "c2", "content": "second"},
                 {"role": "tool", "tool_call_id": "c1", "content": "first"}], {"thinking": False})
    text = ours.render(messages=case.messages, **case.kwargs)
    assert text.index('tool="t1" index="1"<|sep|>first') < text.index('tool="t2" index="2"<|sep|>second')
    assert text == _theirs(theirs, case)


def _effort(template, effort: str, **kw) -> str:
    return render(template, "t", KimiError, messages=[{"role": "user", "content": "q"}], add_generation_prompt=True,
                  thinking_effort=effort, **kw)


def test_medium_effort_is_refused_by_llama_cpp_and_rendered_by_ours(ours, theirs):
    """llama.cpp's template refuses `medium` although its own effort message lists it among the
    supported values; ours renders it as it renders the others."""
    with pytest.raises(KimiError, match="Unsupported thinking_effort=medium"):
        _effort(theirs, "medium")
    high = _effort(theirs, "high")
    assert high.count("`thinking_effort=high`") == 1
    assert _effort(ours, "medium") == high.replace("`thinking_effort=high`", "`thinking_effort=medium`")


USER = {"role": "user", "content": "q"}


@pytest.mark.parametrize("messages, kwargs, ours_says", [
    ([{"role": "developer", "content": "x"}, USER], {}, "no role developer"),
    ([{"role": "system", "content": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, USER], {},
     "a system message that declares tools has no content of its own"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}], {},
     "not image_url"),
    ([USER], {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice must be"),
    ([USER], {"response_format": {"type": "xml"}}, "response_format must be"),
    ([USER], {"response_format": {"type": "json_schema"}}, "json_schema needs its schema"),
], ids=["unknown-role", "lazy-tools-with-text", "image_url", "named-tool-choice", "unknown-format", "no-schema"])
def test_where_llama_cpp_drops_or_guesses_ours_refuses(ours, theirs, messages, kwargs, ours_says):
    """llama.cpp's template renders these, leaving out what it cannot place (a role, a system
    message's text, a named tool_choice, a format) or writing a placeholder (an image_url part,
    a null schema); ours refuses them by name (docs/reference/chat-format.md, "Differences from
    llama.cpp's template")."""
    render(theirs, "llama.cpp", KimiError, messages=messages, **kwargs)
    with pytest.raises(KimiError, match=ours_says):
        render(ours, "ours", KimiError, messages=messages, **kwargs)


def test_a_video_part_is_a_media_block_where_llama_cpp_writes_nothing(ours, theirs):
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens?"}]}]
    a, b = (render(t, "t", KimiError, messages=messages, thinking=False) for t in (ours, theirs))
    assert a == b.replace("what happens?", "<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"
                                           "what happens?")


@pytest.mark.parametrize("messages", [
    [USER, {"role": "tool", "content": "r"}],  # no call before it, no tool or name
    [USER, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}],
    [USER, {"role": "assistant", "content": "", "tool_calls": ["f"]}],
    [USER, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 7}}]}],
], ids=["unnamed-result", "unnamed-call", "call-not-an-object", "arguments-a-number"])
def test_what_neither_can_render_both_refuse(ours, theirs, messages):
    for template in (ours, theirs):
        with pytest.raises(KimiError):
            render(template, "t", KimiError, messages=messages)
