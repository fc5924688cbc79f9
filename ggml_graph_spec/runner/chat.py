"""Conversation mode of kimi-k3-cli (llama-cli's -cnv / -i): turns, the chat template, the input reader.

Each turn feeds the model only what is new. For a chat the new text is what the template renders
for the conversation with the new user message, past the rendering of the conversation before it
(llama.cpp's way of formatting one message at a time); the model's own reply is already in the
caches as the tokens it sampled. A reply cut short (Ctrl-C, -n, a reverse prompt) is closed with
the EOS token before the next turn, as llama-cli does, so the next turn starts after a finished
one. `-i` without a template feeds the user's text as it is.

With --mmproj a turn may hold images and clips (the command line's go with the first turn,
`/image FILE` and `/video F0,F1` add one to the next): its user message's content is then parts,
the text around its `<__media__>` markers and each item's part, which the template renders with its
own media placeholder (the built-in K3 template: K3's media block); each placeholder token of the
turn's new tokens is replaced by its item's rows (generation/media.py). A turn whose markers or
placeholders do not match its items, or a file that cannot be used, is an error line; the
conversation goes on.

A chat reply is parsed as it is sampled (chat/reply.py; shown by display.py): the history keeps
its answer as `content` and its thinking as `reasoning_content`, for the template to render (K3's
puts it in the think element). Each reply is constrained as the server constrains one (no tools
section, the reasoning budget, the answer held to -j/--grammar: agent_args.py). /regen restores the
sequence's state from before the last turn (each turn keeps a copy: the size of the caches'
used rows); /load feeds a saved conversation to empty caches.

The input reader takes lines from a terminal (prompt `> `, a line ending in `\\` continues on the
next one) or from a pipe (no prompt); the loop and its commands are session.py's.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gguf_arch.arch.chat_template import SAMPLE_CONVERSATION
from gguf_arch.arch.template_sandbox import compile_template, render
from gguf_arch.io.console import UsageError
from gguf_arch.io.jsonfile import not_unicode, read_text

from ..chat.reply import ReplyParser
from ..engine.model import Model
from ..generation.batch import Prompt
from ..generation.events import Reply, StopRules, Timings
from ..generation.generate import GenerationError, check_fits, generate
from ..generation.media import media_runs, plan_media
from ..generation.sampling import Sampler
from ..text.chat_template import RESERVED_KWARGS, ChatTemplate, reserved_kwargs
from ..text.tokenizer import BPETokenizer
from ..vision.encode import VisionEncoder
from ..vision.preprocess import MediaItem
from ..vision.prompt import PromptError, expand_markers, media_content
from ..chat.reasoning import reply_start
from .agent_args import ReplyOptions, reply_constraint
from .display import ReplyView
from .interrupt import Interrupt
from .media import command_item


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """llama-cli's conversation options."""
    g = p.add_argument_group("conversation (the default without -p/-f)")
    g.add_argument("-cnv", "--conversation", dest="conversation", action="store_const", const=True, default=None,
                   help="chat: each input is a user turn rendered with the chat template; -p/-f is the first one")
    g.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_const", const=False,
                   help="no conversation: complete -p/-f (with -i: feed the input as it is)")
    g.add_argument("-i", "--interactive", action="store_true",
                   help="read more input after each reply (a conversation with a chat template unless -no-cnv)")
    g.add_argument("-sys", "--system-prompt", metavar="PROMPT", help="system message of the conversation")
    g.add_argument("-sysf", "--system-prompt-file", type=Path, metavar="FILE",
                   help="read the system message from FILE (one final newline dropped, as llama.cpp does)")
    g.add_argument("-sp", "--special", action="store_true",
                   help="show the special tokens and tag markup of a chat reply (a completion shows them anyway)")
    add_template_arguments(g)
    g.add_argument("-r", "--reverse-prompt", action="append", default=[], metavar="PROMPT",
                   help="stop the reply when the output shows PROMPT and return control (repeatable)")
    g.add_argument("-st", "--single-turn", action="store_true",
                   help="one turn, then exit: the reply to -p/-f, or to the first input line")


def add_template_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--chat-template, --chat-template-file, --chat-template-kwargs: both runners'."""
    p.add_argument("--chat-template", metavar="JINJA",
                   help="the text of a Jinja chat template to use instead of the GGUF's tokenizer.chat_template "
                        "(llama.cpp's built-in template names are not known here)")
    p.add_argument("--chat-template-file", type=Path, metavar="FILE",
                   help="Jinja chat template to use instead of the GGUF's tokenizer.chat_template")
    p.add_argument("--chat-template-kwargs", metavar="JSON",
                   help='extra template variables as a JSON object, e.g. \'{"thinking": false}\'')


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """--chat-template-kwargs: a JSON object of extra template variables (llama.cpp's option)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--chat-template-kwargs: not JSON ({exc})") from None
    except RecursionError:
        raise UsageError("--chat-template-kwargs: JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise UsageError(f"--chat-template-kwargs: expected a JSON object, got {text!r}")
    where = not_unicode(value)
    if where is not None:
        raise UsageError(f"--chat-template-kwargs: '{where}' is not valid Unicode (a lone surrogate escape such as "
                         "\\ud800)")
    reserved = reserved_kwargs(value)
    if reserved:
        raise UsageError(f"--chat-template-kwargs: {', '.join(reserved)} is set by the runner for every template "
                         f"(reserved: {', '.join(RESERVED_KWARGS)}); give another name")
    return value


def check_chat_options(a: argparse.Namespace) -> None:
    """Before loading: --chat-template-kwargs parsed (`a.template_kwargs`), -sysf read,
    --chat-template or --chat-template-file read (a FIFO or directory refused, not waited on),
    compiled and rendered once on a sample conversation (`a.template_file`: where and its text),
    so that a bad one costs no load."""
    a.template_kwargs = parse_template_kwargs(a.chat_template_kwargs) if a.chat_template_kwargs is not None else {}
    a.template_file = None
    if getattr(a, "system_prompt_file", None) is not None:  # llama.cpp drops one final newline
        a.system_prompt = read_text(a.system_prompt_file, UsageError, "no such file").removesuffix("\n")
    where, text = template_source(a)
    if text is None:
        return
    system = [{"role": "system", "content": a.system_prompt}] if getattr(a, "system_prompt", None) is not None else []
    render(compile_template(text, where, UsageError), where, UsageError,
           **{"bos_token": "", "eos_token": "", **a.template_kwargs},
           messages=system + list(SAMPLE_CONVERSATION), add_generation_prompt=True)
    a.template_file = (where, text)


def template_source(a: argparse.Namespace) -> tuple[str, str | None]:
    """(where, text) of --chat-template or --chat-template-file; (_, None) with neither."""
    if getattr(a, "chat_template", None) is not None and a.chat_template_file is not None:
        raise UsageError("--chat-template and --chat-template-file both give the template: give one")
    if getattr(a, "chat_template", None) is not None:
        if "{{" not in a.chat_template and "{%" not in a.chat_template:
            raise UsageError(f"--chat-template {a.chat_template}: llama.cpp's built-in template names are not known "
                             "here; give the template's Jinja text, or --chat-template-file FILE")
        return "--chat-template", a.chat_template
    if a.chat_template_file is None:
        return "", None
    return str(a.chat_template_file), read_text(a.chat_template_file, UsageError, "no such file")


@dataclass
class _Undo:
    """What a reply started from: the sequence's state before its turn was fed, the turn's tokens,
    the conversation's rendering before it and its messages with the turn's user message."""

    state: bytes
    rendered: str
    unevaluated: list[int]
    n_before: int  # messages before the turn
    n_messages: int = 0  # with the turn's user message
    tokens: Prompt = field(default_factory=list)
    start: str = "text"


@dataclass
class Conversation:
    """One conversation on one model: what was said, and what the caches still lack."""

    model: Model
    tokenizer: BPETokenizer
    sampler: Sampler
    stop: StopRules
    template: ChatTemplate | None  # None: -i, the user's text goes in as it is
    encoder: VisionEncoder | None = None  # with --mmproj: turns may hold images and clips
    messages: list[dict[str, Any]] = field(default_factory=list)
    pending: list[MediaItem] = field(default_factory=list)  # the next turn's images and clips
    options: ReplyOptions = field(default_factory=ReplyOptions)  # the agent flags: reasoning, a grammar
    color: bool = False  # grey thinking (stdout is a terminal)
    special: bool = False  # -sp: a chat reply is printed whole, its special tokens and tag markup too
    _rendered: str = ""  # the template's rendering of `messages`, without a generation prompt
    _unevaluated: list[int] = field(default_factory=list)  # the end of the last reply, not yet in the caches
    _start: str = "text"  # the channel the last generation prompt opened (think, response; text: not K3's)
    _undo: _Undo | None = None  # the last reply's starting point (/regen)

    def new_tokens(self, user_text: str, items: list[MediaItem] | None = None) -> list[int]:
        """The tokens this turn adds to the caches: the end of the last reply, then the turn (with
        its items, one placeholder each). The user message is kept only once it renders."""
        first = self.model.n_past == 0 and not self._unevaluated
        if self.encoder is not None and not items:
            expand_markers(user_text, [])  # a marker without its image or clip is an error
        if self.template is None:
            text = expand_markers(user_text, items) if items else user_text
        else:
            message = {"role": "user", "content": media_content(user_text, items) if items else user_text}
            full = self.template.render(self.messages + [message], add_generation_prompt=True)
            text = full[_common_prefix(self._rendered, full):]
            self._start = reply_start(full)
            self.messages.append(message)
        ids = self.tokenizer.encode(text, add_bos=None if first else False)
        return self._unevaluated + ids

    def new_input(self, user_text: str, timings: Timings) -> Prompt:
        """new_tokens, with the pending items' rows in place of their placeholders (runs of ids
        and rows; checked to fit the context before anything is encoded)."""
        items, self.pending = self.pending, []
        tokens = self.new_tokens(user_text, items)
        if not items:
            return tokens
        try:
            prompt = plan_media(self.encoder, tokens, items)
        except PromptError:
            if self.template is not None:
                self.messages.pop()  # the turn is not held: the template lost or added a placeholder
            raise
        check_fits(self.model, 0, len(prompt))
        return media_runs(self.model, self.encoder, prompt, timings)

    def attach(self, command: str, arg: str) -> None:
        """A /image or /video line: its item goes with the next turn."""
        self.pending.append(command_item(self.encoder, command, arg))

    def turn(self, user_text: str, out: TextIO, timings: Timings, interrupt: Interrupt | None = None) -> Reply:
        """Feed the user's turn, stream the reply to `out`, and keep what the next turn needs. A
        turn that cannot be fed (it does not fit the context) leaves the conversation as it was."""
        undo = _Undo(self.model.state_get(0), self._rendered, list(self._unevaluated), len(self.messages))
        try:
            undo.tokens = self.new_input(user_text, timings)
        except BaseException:
            self._back_to(undo)
            raise
        undo.n_messages, undo.start = len(self.messages), self._start
        return self._reply(undo, out, timings, interrupt)

    def regenerate(self, out: TextIO, timings: Timings, interrupt: Interrupt | None = None) -> Reply:
        """/regen: the last reply dropped, and generated again from the state it started from (the
        sampler's RNG goes on: a sampled reply comes out differently, a greedy one the same)."""
        undo = self._undo
        if undo is None:
            raise UsageError("/regen: no reply to regenerate yet" if self.model.n_past == 0 else
                             "/regen: no reply of this conversation to regenerate (after /load or /clear)")
        self.model.state_set(0, undo.state, "the state before the last reply")
        self.messages = self.messages[:undo.n_messages]
        self._rendered, self._start = undo.rendered, undo.start
        return self._reply(undo, out, timings, interrupt)

    def clear(self) -> None:
        """/clear: the conversation forgotten (its system message kept), the caches reset."""
        self.model.reset()
        self.messages = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        self._rendered, self._unevaluated, self.pending, self._undo = "", [], [], None

    def load(self, messages: list[dict[str, Any]], timings: Timings, interrupt: Interrupt | None = None) -> int:
        """/load: `messages` become the conversation, fed to empty caches as the template renders
        them (the model reads them as written, not as it once sampled them); the tokens fed. One
        that does not fit the context, or a load cut by Ctrl-C, leaves the conversation as it was."""
        if self.template is None:
            raise UsageError("/load needs a chat template (without one, -i -no-cnv feeds text as it is)")
        text = self.template.render(messages, add_generation_prompt=False)
        ids = self.tokenizer.encode(text)
        if len(ids) >= self.model.n_ctx:
            raise GenerationError(f"the conversation is {len(ids)} tokens, the context -c {self.model.n_ctx}: "
                                  "raise -c")
        before = self.model.state_get(0)
        self.model.reset()
        if not _feed(self.model, ids, timings, interrupt):
            self.model.state_set(0, before, "the state before /load")
            raise UsageError("/load interrupted: the conversation is as it was")
        self.messages, self._rendered = list(messages), text
        self._unevaluated, self.pending, self._undo = [], [], None
        return len(ids)

    def _back_to(self, undo: _Undo) -> None:
        """The conversation as it was before a turn that was not fed (the caches never changed; the
        turn's images and clips go with it, as a turn whose media fail drops them)."""
        self.messages = self.messages[:undo.n_before]
        self._rendered, self._unevaluated = undo.rendered, undo.unevaluated

    def _reply(self, undo: _Undo, out: TextIO, timings: Timings, interrupt: Interrupt | None) -> Reply:
        self.sampler.reset()
        view = ReplyView(self.tokenizer, self._start, self.options.inline, self.color) \
            if self.template is not None and not self.special else None
        # -sp prints every token as it is; the reply is still parsed for the conversation's history
        raw = ReplyParser(self.tokenizer, self._start) if self.template is not None and self.special else None
        show = view.show if view else (lambda t: raw.feed(t) or True) if raw else (lambda _t: True)
        try:
            generation = generate(self.model, undo.tokens, self.sampler, self.stop, timings=timings, show=show,
                                  stop_requested=_flag(interrupt),
                                  constraint=reply_constraint(self.tokenizer, self._start, self.options))
        except GenerationError:
            self._back_to(undo)
            raise
        reply, parsed = view.stream(generation, out) if view else (stream(generation, out), None)
        if raw is not None:
            parsed = raw.finish()
        self._undo = undo
        self._unevaluated = [] if reply.pending is None else [reply.pending]
        if self.template is not None:
            if reply.reason != "eog" and self.tokenizer.eos_id is not None:
                self._unevaluated.append(self.tokenizer.eos_id)
            message = {"role": "assistant", "content": parsed.content}
            if parsed.reasoning:  # the template decides whether to render it (K3's: in the think element)
                message["reasoning_content"] = parsed.reasoning
            self.messages.append(message)
            self._rendered = self.template.render(self.messages, add_generation_prompt=False)
        return reply


def _feed(model: Model, ids: list[int], timings: Timings, interrupt: Interrupt | None) -> bool:
    """Evaluate `ids` on sequence 0, -b tokens at a time; False when a Ctrl-C stopped it."""
    for i in range(0, len(ids), model.n_batch):
        if interrupt is not None and interrupt.requested:
            return False
        chunk = ids[i:i + model.n_batch]
        t = time.perf_counter()
        model.decode({0: chunk})
        timings.prompt_s += time.perf_counter() - t
        timings.prompt_tokens += len(chunk)
    return True


def stream(generation, out: TextIO) -> Reply:
    """Print a generation's text as it comes."""
    for event in generation:
        out.write(event.text)
        out.flush()
    return generation.reply


def _flag(interrupt: Interrupt | None):
    return (lambda: False) if interrupt is None else (lambda: interrupt.requested)


def _common_prefix(a: str, b: str) -> int:
    # A template renders a longer conversation as the shorter one plus the new turn; where one does
    # not (a template that rewrites past turns), only the part after the common prefix is new.
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class LineReader:
    """User input: from a terminal with a `> ` prompt and `\\` continuation lines, or from a pipe.
    No stdin at all (`<&-`) is an empty input; a line that is not UTF-8 is refused, naming it."""

    def __init__(self, stdin: TextIO | None, out: TextIO) -> None:
        self._stdin, self._out = stdin, out
        self.terminal = stdin is not None and stdin.isatty()
        self._lines = 0

    def _line(self, prompt: str) -> str | None:
        if self._stdin is None:
            return None
        self._lines += 1
        try:
            line = self._read(prompt)
        except UnicodeDecodeError:
            line = None
        else:  # decoded with surrogateescape (a C locale): the bytes that were not UTF-8 show here
            if line is None or not any("\udc80" <= c <= "\udcff" for c in line):
                return line
        raise UsageError(f"standard input, line {self._lines}: not valid UTF-8 text (a conversation takes UTF-8)")

    def _read(self, prompt: str) -> str | None:
        if self.terminal:
            # The prompt goes to stdout as llama-cli writes it (input()'s own prompt may go to stderr).
            self._out.write(prompt)
            self._out.flush()
            try:
                return input()
            except EOFError:
                return None
        line = self._stdin.readline()
        return line.rstrip("\n") if line else None

    def read(self) -> str | None:
        """The next input (lines joined), or None at the end of input."""
        parts: list[str] = []
        line = self._line("> ")
        while line is not None and line.endswith("\\"):
            parts.append(line[:-1])
            line = self._line("")
        if line is None:
            return "\n".join(parts) if parts else None
        return "\n".join(parts + [line])
