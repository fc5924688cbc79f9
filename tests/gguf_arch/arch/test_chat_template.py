"""tokenizer.chat_template: the built-in K3 template checked token by token against K3's chat format,
and the checkpoint's own template taking precedence in the GGUF."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE, compile_template
from gguf_arch.convert.run import convert
from ggml_graph_spec.text.tokenizer import BPETokenizer

from tests.support.paths import REPO

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
               "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort={}`.")
CONVERSATION = [{"role": "system", "content": "You answer in one line."},
                {"role": "user", "content": "Name a \"safe\" harbour & a lighthouse."},
                {"role": "assistant", "content": "Dover.", "reasoning_content": "A short answer."}]


@pytest.fixture(scope="module")
def tokenizer(k3_tiny_gguf) -> BPETokenizer:
    return BPETokenizer.from_gguf(k3_tiny_gguf)


def _render(messages, **kwargs) -> str:
    return compile_template(K3_CHAT_TEMPLATE, "test").render(messages=messages, **kwargs)


class Expected:
    """The format written out piece by piece: specials by id, everything else through the tokenizer."""

    def __init__(self, tokenizer: BPETokenizer) -> None:
        self.t, self.ids = tokenizer, []

    def special(self, text: str) -> "Expected":
        token = self.t.special_id(text)
        assert token is not None, text
        self.ids.append(token)
        return self

    def text(self, text: str) -> "Expected":
        self.ids += self.t.encode(text, add_bos=False, allow_special=False)
        return self

    def open(self, head: str) -> "Expected":
        return self.special(OPEN).text(head).special(SEP)

    def close(self, name: str) -> "Expected":
        return self.special(CLOSE).text(name).special(SEP)

    def turn(self, head: str, body: str) -> "Expected":
        return self.open(f"message {head}").text(body).close("message").special(END)


def test_system_user_assistant_token_by_token(tokenizer):
    rendered = _render(CONVERSATION, add_generation_prompt=False)
    want = (Expected(tokenizer)
            .turn('role="system" type="thinking-effort"', EFFORT_TEXT.format("max"))
            .turn('role="system"', "You answer in one line.")
            .turn('role="user"', "Name a \"safe\" harbour & a lighthouse.")
            .open('message role="assistant"').open("think").text("A short answer.").close("think")
            .open("response").text("Dover.").close("response").close("message").special(END))
    assert tokenizer.encode(rendered, add_bos=False) == want.ids


def test_generation_prompt_opens_the_assistant_turn_and_its_first_channel(tokenizer):
    user = [{"role": "user", "content": "Hi"}]
    for kwargs, channel in (({}, "think"), ({"thinking": False}, "response")):
        rendered = _render(user, add_generation_prompt=True, **kwargs)
        start = [] if kwargs else Expected(tokenizer).turn('role="system" type="thinking-effort"',
                                                           EFFORT_TEXT.format("max")).ids
        want = Expected(tokenizer).turn('role="user"', "Hi").open('message role="assistant"').open(channel)
        assert tokenizer.encode(rendered, add_bos=False) == start + want.ids


def test_thinking_off_has_no_think_channel_and_attributes_are_escaped():
    rendered = _render([{"role": "user", "name": 'a"b&c', "content": [{"type": "text", "text": "x"},
                                                                        {"type": "text", "text": "y"}]},
                        {"role": "assistant", "content": "z"}], thinking=False)
    assert rendered == (f'{OPEN}message role="user" name="a&quot;b&amp;c"{SEP}xy{CLOSE}message{SEP}{END}'
                        f'{OPEN}message role="assistant"{SEP}{OPEN}response{SEP}z{CLOSE}response{SEP}'
                        f'{CLOSE}message{SEP}{END}')


def test_the_effort_is_named_and_checked():
    assert EFFORT_TEXT.format("low") in _render([], thinking_effort="low")
    with pytest.raises(Exception, match="thinking_effort must be low, medium, high or max"):
        _render([], thinking_effort="extreme")


@pytest.mark.parametrize("messages, kwargs, message", [
    # llama.cpp's template skips a role it does not know; ours never drops a message unsaid.
    ([{"role": "developer", "content": "x"}], {}, "no role developer"),
    ([{"role": "tool", "content": "x"}], {}, "a tool result needs its tool"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}], {},
     "a tool call needs its function name"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}], {},
     "tool call arguments must be an object or a JSON string"),
    ([{"role": "system", "content": "x", "tools": [{"type": "function"}]}], {},
     "a system message that declares tools has no content of its own"),
    ([{"role": "user", "content": [{"type": "image"}]}], {}, "an image part needs its width and height"),
    ([{"role": "user", "content": [{"type": "audio"}]}], {}, "text, image and video parts, not audio"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     "text, image and video parts, not image_url"),
    ([], {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice must be auto, required or none"),
    ([], {"response_format": {"type": "xml"}}, "response_format must be text, json_object or json_schema"),
    ([], {"response_format": {"type": "json_schema"}}, "response_format json_schema needs its schema"),
])
def test_what_the_built_in_template_does_not_render_is_an_error(messages, kwargs, message):
    with pytest.raises(Exception, match=message):
        _render(messages, **kwargs)


def test_image_and_video_parts_are_k3s_media_blocks_in_place(tokenizer):
    """The block Moonshot's image processor writes for an image (its original size) or a clip, at
    the part's place among the text parts; one <|media_pad|> per item, tokenized as the special."""
    content = [{"type": "image", "width": 48, "height": 32}, {"type": "text", "text": "and"},
               {"type": "video", "frames": 2, "width": 32, "height": 24}, {"type": "text", "text": "show"}]
    text = _render([{"role": "user", "content": content}], thinking=False)
    blocks = ("<|media_begin|>image 48x32<|media_content|><|media_pad|><|media_end|>and"
              "<|media_begin|>video<|media_content|><|media_pad|><|media_end|>show")
    assert text == f'{OPEN}message role="user"{SEP}{blocks}{CLOSE}message{SEP}{END}'
    assert tokenizer.encode(text).count(tokenizer.special_id("<|media_pad|>")) == 2


def _gguf_template(gguf: Path) -> str:
    return GGUFReader(gguf).fields["tokenizer.chat_template"].contents()


def test_a_checkpoint_without_a_template_gets_the_k3_template(k3_tiny_gguf, k31pro_tiny_gguf):
    assert _gguf_template(k3_tiny_gguf) == K3_CHAT_TEMPLATE
    assert _gguf_template(k31pro_tiny_gguf) == K3_CHAT_TEMPLATE


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _with_config_template(model: Path, value) -> None:
    path = model / "tokenizer_config.json"
    raw = json.loads(path.read_text())
    raw["chat_template"] = value
    path.write_text(json.dumps(raw))


def test_the_checkpoints_own_template_wins(tmp_path, k3_tiny_dir):
    model = _copy(k3_tiny_dir, tmp_path / "model")
    _with_config_template(model, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    convert(model, tmp_path / "a.gguf", log=lambda _m: None)
    assert _gguf_template(tmp_path / "a.gguf") == "D"
    (model / "chat_template.jinja").write_text("{{ messages[0].content }}", encoding="utf-8")
    convert(model, tmp_path / "b.gguf", log=lambda _m: None)
    assert _gguf_template(tmp_path / "b.gguf") == "{{ messages[0].content }}"


@pytest.mark.parametrize("value, message", [
    ("{% for m in messages %}", "chat template line 1: Unexpected end of template"),
    (7, "chat_template must be a string or a list with a 'default' template"),
])
def test_a_broken_checkpoint_template_is_bad_input(tmp_path, k3_tiny_dir, value, message):
    model = _copy(k3_tiny_dir, tmp_path / "model")
    _with_config_template(model, value)
    r = subprocess.run([sys.executable, str(REPO / "convert_kimi_k3.py"), str(model), str(tmp_path / "x.gguf")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert message in r.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_a_hostile_template_is_an_error_not_a_crash(tokenizer):
    from gguf_arch.errors import KimiError
    from ggml_graph_spec.text.chat_template import ChatTemplate

    with pytest.raises(KimiError, match="nested too deeply"):
        compile_template("{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}", "deep")
    endless = ChatTemplate("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "endless", tokenizer, {})
    with pytest.raises(KimiError, match="recursion too deep"):
        endless.render([], add_generation_prompt=True)
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}", "escape", tokenizer, {})
    with pytest.raises(KimiError, match="chat template"):  # the sandbox refuses Python internals
        escape.render([], add_generation_prompt=True)


def test_the_template_writes_the_markup_xtml_names():
    """gguf_arch/arch/xtml.py holds the markup's facts for the reply parser and the grammars; the
    template spells them in Jinja, and spells no other marker or element."""
    from gguf_arch.arch import xtml

    media = {"<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"}
    assert set(re.findall(r"<\|[a-z_]+\|>", K3_CHAT_TEMPLATE)) - media == set(xtml.MARKERS)
    names = set(re.findall(r"(?:opening|element|closing)\('([a-z]+)'", K3_CHAT_TEMPLATE))
    names |= {n for pair in re.findall(r"opening\('(\w+)' if think else '(\w+)'\)", K3_CHAT_TEMPLATE) for n in pair}
    assert names == {xtml.MESSAGE, xtml.THINK, xtml.RESPONSE, xtml.TOOLS, xtml.CALL, xtml.ARGUMENT, xtml.JSON_BLOCK}
    calls = [{"function": {"name": 'a"b&c', "arguments": {"k": v}}} for v in ("s", 1, True, None, {}, [])]
    text = _render([{"role": "assistant", "content": "", "tool_calls": calls}], thinking=False)
    assert text.count(xtml.opening(xtml.CALL, tool='a"b&c', index="1")) == 1
    assert [t for t in xtml.ARGUMENT_TYPES if xtml.opening(xtml.ARGUMENT, key="k", type=t) in text] == \
        list(xtml.ARGUMENT_TYPES)
