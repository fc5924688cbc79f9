"""kimi-k3-cli's conversation at a real terminal (a pseudo-terminal: tests/support/pty_run.py): the
banner, each slash command, an unknown one refused, thinking shown apart, -st, and Ctrl-C at the
prompt. The replies are checked against the library's Conversation run in this process."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE
from gguf_arch.errors import EXIT_INTERRUPTED
from ggml_graph_spec.chat.grammar import JsonSchema
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.generation.events import StopRules, Timings
from ggml_graph_spec.generation.sampling import Sampler, SamplingParams
from ggml_graph_spec.runner.agent_args import ReplyOptions
from ggml_graph_spec.runner.chat import Conversation
from ggml_graph_spec.runner.display import END_THINKING, GREY, RESET, START_THINKING
from ggml_graph_spec.text.chat_template import ChatTemplate
from tests.support.pty_run import PtyRun

# Thinking off: the greedy replies are the answer only (thinking's display has its own test).
CHAT = ("-cnv", "-n", "6", "--temp", "0", "-c", "1024", "-t", "2", "--exact-experts", "-rea", "off")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
def terminal(tmp_path):
    runs: list[PtyRun] = []

    def start(gguf: Path, *args: str) -> PtyRun:
        runs.append(PtyRun(["-m", gguf, *args], tmp_path / f"stderr{len(runs)}"))
        return runs[-1]

    yield start
    for r in runs:
        r.close()


def _conversation(model: Model, thinking: bool = False, options: ReplyOptions = ReplyOptions(),
                  n_predict: int = 6) -> Conversation:
    tok = model.tokenizer
    return Conversation(model, tok, Sampler(SamplingParams(temp=0.0)), StopRules(frozenset({tok.eos_id}), n_predict),
                        ChatTemplate(K3_CHAT_TEMPLATE, "test", tok, {"thinking": thinking}), options=options)


def _shown(conv: Conversation, text: str) -> str:
    out = io.StringIO()
    conv.turn(text, out, Timings())
    return out.getvalue()


def _replies(output: str) -> list[str]:
    """What followed each line typed at a prompt, up to the next prompt (the reply, without the
    newline that ends it); the last prompt's too."""
    parts = ("\n" + output).split("\n> ")[1:]
    return [p.split("\n", 1)[1] if "\n" in p else "" for p in parts]


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_the_banner_and_help_say_what_the_mode_does_and_an_unknown_command_is_refused(terminal, k3_tiny_gguf):
    t = terminal(k3_tiny_gguf, *CHAT)
    t.line("/help")
    t.line("/foo bar")
    t.line("/exit")
    assert t.wait() == 0
    err = t.err()
    assert "== Conversation: each input is a user message, rendered with the chat template ==" in err
    assert " - commands: /help, /clear, /regen, /read, /save, /load, /exit (/help says what each does)" in err
    assert "Press Return" not in err and "interactive mode" not in err
    for line in ("  /regen      drop the last reply and generate it again from the same state",
                 "  /save FILE  write the conversation to FILE as JSON messages"):
        assert line in err.splitlines(), err
    assert _errors(err) == ["error: unknown command /foo: /help lists them (a message starting with '/': type '//')"]
    assert "prompt eval time =       0.00 ms /     0 tokens" in err  # nothing reached the model
    assert _replies(t.output) == ["", "", ""]  # no reply to /help or /foo


def test_regen_generates_the_last_reply_again_and_replaces_it(terminal, tmp_path, k3_tiny_gguf):
    t = terminal(k3_tiny_gguf, *CHAT)
    for line in ("/regen", "Hello there", "/regen", f"/save {tmp_path / 'c.json'}", "/exit"):
        t.line(line)
    assert t.wait() == 0
    model = Model.load(k3_tiny_gguf, n_ctx=1024, exact_experts=True, n_threads=2)
    try:
        reply = _shown(_conversation(model), "Hello there")
    finally:
        model.close()
    assert _replies(t.output)[1:3] == [reply, reply]  # greedy: the same reply again
    assert _errors(t.err()) == ["error: /regen: no reply to regenerate yet"]
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved == [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": reply}]


def test_clear_forgets_the_conversation_but_keeps_the_system_prompt(terminal, tmp_path, k3_tiny_gguf):
    t = terminal(k3_tiny_gguf, *CHAT, "-sys", "You are terse.")
    for line in ("Hello there", "/clear", "Hello there", f"/save {tmp_path / 'c.json'}", "/exit"):
        t.line(line)
    assert t.wait() == 0
    replies = _replies(t.output)
    assert replies[0] == replies[2] != ""  # after /clear the same turn from empty caches: the same reply
    assert "conversation cleared (its system message kept)" in t.err()
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [m["role"] for m in saved] == ["system", "user", "assistant"] and saved[0]["content"] == "You are terse."


def test_read_puts_a_file_in_front_of_the_next_message_and_a_bad_file_is_one_error(terminal, tmp_path,
                                                                                   k3_tiny_gguf):
    (tmp_path / "notes.txt").write_text("the tide is high", encoding="utf-8")
    t = terminal(k3_tiny_gguf, *CHAT)
    for line in (f"/read {tmp_path / 'absent.txt'}", f"/read {tmp_path / 'notes.txt'}", "What is high?",
                 f"/save {tmp_path / 'c.json'}", "/exit"):
        t.line(line)
    assert t.wait() == 0
    assert _errors(t.err()) == [f"error: {tmp_path / 'absent.txt'}: no such file"]
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved[0] == {"role": "user", "content": f"--- File: {tmp_path / 'notes.txt'} ---\nthe tide is high\n"
                                                   "What is high?"}


def test_save_then_load_restores_the_same_conversation(terminal, tmp_path, k3_tiny_gguf):
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    t = terminal(k3_tiny_gguf, *CHAT, "-sys", "You are terse.")
    for line in ("Hello there", "And then?", f"/save {first}", "/exit"):
        t.line(line)
    assert t.wait() == 0
    t = terminal(k3_tiny_gguf, *CHAT)
    (tmp_path / "bad.json").write_text('[{"role": "user", "content": 3}]', encoding="utf-8")
    for line in (f"/load {tmp_path / 'bad.json'}", f"/load {first}", f"/save {again}", "More?", "/exit"):
        t.line(line)
    assert t.wait() == 0
    assert again.read_text() == first.read_text()
    assert _errors(t.err()) == [f"error: {tmp_path / 'bad.json'}: messages[0].content must be a string (a saved "
                                "conversation is text only)"]
    model = Model.load(k3_tiny_gguf, n_ctx=1024, exact_experts=True, n_threads=2)
    try:
        conv = _conversation(model)
        conv.load(json.loads(first.read_text()), Timings())
        assert model.seq_tokens(0) == model.tokenizer.encode(conv.template.render(conv.messages, False))
        expected = _shown(conv, "More?")
    finally:
        model.close()
    assert _replies(t.output)[3] == expected


def test_thinking_is_shown_apart_and_greyed_on_a_terminal(terminal, tmp_path, k3_tiny_gguf):
    # A budget of 4 think tokens, then the schema: the answer follows the thinking.
    t = terminal(k3_tiny_gguf, "-cnv", "-n", "64", "--temp", "0", "-c", "1024", "-t", "2", "--exact-experts",
                 "--reasoning-budget", "4", "-j", json.dumps(SCHEMA))
    t.line("Hello there")
    t.line(f"/save {tmp_path / 'c.json'}")
    t.line("/exit")
    assert t.wait() == 0
    model = Model.load(k3_tiny_gguf, n_ctx=1024, exact_experts=True, n_threads=2)
    try:
        conv = _conversation(model, True, ReplyOptions(reasoning_budget=4, response=JsonSchema(SCHEMA)), 64)
        plain = _shown(conv, "Hello there")
    finally:
        model.close()
    shown = _replies(t.output)[0]
    reasoning, answer = plain.removeprefix(START_THINKING + "\n").split(f"\n{END_THINKING}\n\n")
    assert reasoning.strip() and isinstance(json.loads(answer)["a"], int)
    assert shown == f"{GREY}{START_THINKING}\n{reasoning}\n{END_THINKING}{RESET}\n\n{answer}"
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved[1] == {"role": "assistant", "content": answer, "reasoning_content": reasoning}


def test_single_turn_answers_once_and_exits(terminal, k3_tiny_gguf):
    t = terminal(k3_tiny_gguf, *CHAT, "-st")
    t.line("Hello there")
    assert t.wait() == 0
    assert t.prompts() == 1 and _replies(t.output)[0].strip()
    t = terminal(k3_tiny_gguf, *CHAT, "-st", "-p", "Hello there")
    assert t.wait() == 0
    assert t.prompts() == 0 and t.output.strip()  # the reply to -p; stdin never read


def test_ctrl_c_at_the_prompt_ends_quietly_with_the_timings_and_exit_130(terminal, k3_tiny_gguf):
    t = terminal(k3_tiny_gguf, *CHAT)
    t.line("Hello there")
    t.wait_prompt(2)  # the reply is over: Ctrl-C at the prompt
    t.ctrl_c()
    assert t.wait() == EXIT_INTERRUPTED
    err = t.err()
    assert "kimi_k3_perf:        total time = " in err and _errors(err) == [], err
