"""kimi-k3-cli's conversation mode as a user drives it: through piped stdin, and through a real
terminal (tmux: keys typed, Ctrl-C sent, the screen read back)."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE
from gguf_arch.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from ggml_graph_spec.runner.chat import Conversation
from ggml_graph_spec.text.chat_template import ChatTemplate
from ggml_graph_spec.generation.events import StopRules, Timings
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.generation.sampling import Sampler, SamplingParams
from ggml_graph_spec.text.tokenizer import BPETokenizer

from tests.support.cli import run_runner as cli
from tests.support.paths import REPO

CHAT = ("-cnv", "-n", "6", "--temp", "0", "-c", "1024", "-t", "2", "--exact-experts")


def _replies(gguf: Path, turns: list[str], system: str | None = None) -> list[str]:
    """The greedy replies of the same conversation run in this process, as they are shown (the
    thinking between its markers, no colour: stdout is not a terminal): the reference for the CLI."""
    tokenizer = BPETokenizer.from_gguf(gguf)
    model = Model.load(gguf, n_ctx=1024, exact_experts=True, n_threads=2)
    try:
        conv = Conversation(model, tokenizer, Sampler(SamplingParams(temp=0.0)),
                            StopRules(frozenset({tokenizer.eos_id}), 6),
                            ChatTemplate(K3_CHAT_TEMPLATE, "test", tokenizer, {}))
        if system is not None:
            conv.messages.append({"role": "system", "content": system})
        shown = []
        for t in turns:
            out = io.StringIO()
            conv.turn(t, out, Timings())
            shown.append(out.getvalue())
        return shown
    finally:
        model.close()


def test_cnv_answers_each_line_of_stdin_and_ends_at_eof(k3_tiny_gguf):
    r = cli("-m", k3_tiny_gguf, *CHAT, stdin="Hello there\nAnd then?\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "".join(reply + "\n" for reply in _replies(k3_tiny_gguf, ["Hello there", "And then?"]))
    assert "chat template: the GGUF's tokenizer.chat_template" in r.stderr
    assert "> " not in r.stdout  # no prompt when the input is not a terminal


def test_exit_ends_the_conversation_and_a_system_prompt_is_its_first_message(k3_tiny_gguf):
    r = cli("-m", k3_tiny_gguf, *CHAT, "-sys", "You are terse.", stdin="Hello there\n/exit\nnever read\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == _replies(k3_tiny_gguf, ["Hello there"], system="You are terse.")[0] + "\n"


def test_a_prompt_is_the_first_turn_and_empty_input_ends_at_once(k3_tiny_gguf):
    r = cli("-m", k3_tiny_gguf, *CHAT, "-p", "Hello there", stdin="")
    assert r.returncode == 0, r.stderr
    assert r.stdout == _replies(k3_tiny_gguf, ["Hello there"])[0] + "\n"
    r = cli("-m", k3_tiny_gguf, *CHAT, stdin="")
    assert (r.returncode, r.stdout) == (0, "")


def test_a_chat_template_file_replaces_the_gguf_template(tmp_path, k3_tiny_gguf):
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    r = cli("-m", k3_tiny_gguf, *CHAT, "--chat-template-file", plain, stdin="Hello there\n")
    assert r.returncode == 0 and f"chat template: {plain}" in r.stderr, r.stderr
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }", encoding="utf-8")
    r = cli("-m", k3_tiny_gguf, *CHAT, "--chat-template-file", broken, stdin="Hello\n")
    assert r.returncode == EXIT_BAD_INPUT and r.stderr.splitlines()[-1].startswith(f"error: {broken}: chat template line 2")


# ---- a real terminal --------------------------------------------------------------------------

TMUX = shutil.which("tmux")


class Terminal:
    """One tmux session on a private server, running a command in a 200x50 terminal."""

    def __init__(self, command: list[str], stderr: Path) -> None:
        self.socket = f"kimi-k3-test-{uuid.uuid4().hex[:8]}"
        # stderr to a file: the screen shows what the program writes to stdout, the prompts included.
        shell = " ".join(_quote(c) for c in command) + f" 2>{_quote(str(stderr))}; echo EXIT=$?; sleep 600"
        self._tmux("new-session", "-d", "-x", "200", "-y", "50", "-s", "t", shell)

    def _tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, "-f", os.devnull, *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-S", "-2000", "-t", "t")

    def wait_for(self, predicate, limit_s: float = 300) -> str:
        """The screen once predicate(screen) holds; the limit only guards against a hang."""
        deadline = time.monotonic() + limit_s
        while not predicate(text := self.screen()):
            assert time.monotonic() < deadline, text
            time.sleep(0.5)
        return text

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


@pytest.fixture
def terminal():
    if TMUX is None:
        pytest.skip("tmux is not installed (Debian package tmux: apt-get install -y tmux); "
                    "the real-terminal conversation test needs it")
    opened: list[Terminal] = []
    yield lambda command, stderr: opened.append(Terminal(command, stderr)) or opened[-1]
    for t in opened:
        t.close()


def _prompts(screen: str) -> int:
    return sum(1 for line in screen.splitlines() if line.startswith("> "))


def _start(terminal, stderr: Path, gguf: Path, *extra: str) -> Terminal:
    env = ["env", f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}"]
    return terminal([*env, sys.executable, "-m", "ggml_graph_spec", "-m", str(gguf), "-c", "8192", "-t", "2", *extra],
                    stderr)


def test_in_a_terminal_ctrl_c_interrupts_the_reply_and_returns_to_the_prompt(terminal, tmp_path, k3_tiny_gguf):
    # --ignore-eos and an 8192-token context: a reply cannot end by itself before Ctrl-C is sent.
    t = _start(terminal, tmp_path / "err", k3_tiny_gguf, "-cnv", "--ignore-eos")
    t.wait_for(lambda s: _prompts(s) == 1)
    t.keys("Hello there", "Enter")
    first = t.wait_for(lambda s: len(s.split("> Hello there", 1)[-1].strip()) > 2)  # the reply is streaming
    assert _prompts(first) == 1
    t.keys("C-c")
    t.wait_for(lambda s: _prompts(s) == 2)  # back at the prompt, the program still running
    t.keys("/exit", "Enter")
    done = t.wait_for(lambda s: "EXIT=" in s)
    assert "EXIT=0" in done and "kimi_k3_perf:        total time = " in (tmp_path / "err").read_text()


def test_in_a_terminal_ctrl_c_at_the_prompt_exits_130_with_the_timings_and_no_error(terminal, tmp_path,
                                                                                   k3_tiny_gguf):
    t = _start(terminal, tmp_path / "err", k3_tiny_gguf, "-cnv", "-n", "4")
    t.wait_for(lambda s: _prompts(s) == 1)
    t.keys("Hello there", "Enter")
    t.wait_for(lambda s: _prompts(s) == 2)  # -n 4: the reply ends, the prompt is back
    t.keys("C-c")
    done = t.wait_for(lambda s: "EXIT=" in s)
    err = (tmp_path / "err").read_text()
    assert f"EXIT={EXIT_INTERRUPTED}" in done and "kimi_k3_perf:         eval time = " in err
    assert not [line for line in err.splitlines() if line.startswith("error:")], err  # the normal way out
