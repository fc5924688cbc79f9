"""kimi-k3-cli's conversation loop: the banner, then each input a message or a command
(commands.py), until /exit, the end of input, Ctrl-C at the prompt or, with -st, one reply.

What goes where: the replies (and the `> ` prompt) on stdout; the banner, what a command says and
every error on stderr, so that stdout piped elsewhere holds the replies only. A command that fails
(a bad file, a /regen with nothing to regenerate) and a turn that cannot be fed (its media, a
message over the context) are one `error:` line each, and the conversation goes on. Ctrl-C during
a reply ends that reply; at the prompt it ends the conversation, as /exit does, but with exit
code 130 (llama-cli's) and no error line.
"""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Callable, Sequence, TextIO

from gguf_arch.errors import KimiError
from gguf_arch.io.console import UsageError

from ..generation.events import Timings
from ..generation.generate import GenerationError
from ..vision.preprocess import MediaError
from ..vision.prompt import PromptError
from . import commands
from ..chat.reasoning import reply_start
from .chat import Conversation, LineReader
from .commands import Command
from .display import END_THINKING, START_THINKING
from .interrupt import sigint_stops

EXIT, TURN = "exit", "turn"  # what an input line did


class PromptExit(KeyboardInterrupt):
    """Ctrl-C at the prompt: the conversation's end (exit 130, no error line)."""


def _error(exc: BaseException) -> None:
    print(f"error: {exc}", file=sys.stderr, flush=True)


@dataclass
class Session:
    """One conversation driven by its input lines."""

    conversation: Conversation
    out: TextIO
    timings: Timings
    note: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    prefix: str = ""  # /read's text, waiting for the next message

    def run_line(self, line: str, message_only: bool = False) -> str | None:
        """One input (-p/-f's first turn: `message_only`, never a command): EXIT, TURN or None."""
        try:
            command = None if message_only else commands.parse_command(line)
        except UsageError as exc:  # an unknown command, a wrong argument: never sent to the model
            _error(exc)
            return None
        try:
            if command is not None:
                return self.command(*command)
            if line.strip():
                self.message(line if message_only else commands.message_text(line))
                return TURN
        except (MediaError, PromptError, GenerationError) as exc:  # this turn only (llama-mtmd-cli's rule)
            _error(exc)
        except KimiError as exc:
            if command is None:
                raise  # a message the template refuses: the conversation cannot go on
            _error(exc)
        return None

    def message(self, text: str) -> None:
        text, self.prefix = self.prefix + text, ""
        with sigint_stops() as interrupt:
            self.conversation.turn(text, self.out, self.timings, interrupt)
        self._end_reply()

    def _end_reply(self) -> None:
        self.out.write("\n")
        self.out.flush()

    def command(self, command: Command, arg: str) -> str | None:
        return _HANDLERS[command.name](self, arg)

    # ---- the commands --------------------------------------------------------------------------
    def _help(self, _arg: str) -> None:
        self.note("commands:")
        for line in commands.help_lines(self.conversation.encoder is not None):
            self.note(line)

    def _clear(self, _arg: str) -> None:
        self.conversation.clear()
        self.prefix = ""
        kept = " (its system message kept)" if self.conversation.messages else ""
        self.note(f"conversation cleared{kept}")

    def _regen(self, _arg: str) -> str:
        with sigint_stops() as interrupt:
            self.conversation.regenerate(self.out, self.timings, interrupt)
        self._end_reply()
        return TURN

    def _read(self, arg: str) -> None:
        text = commands.file_text(arg)
        self.prefix += text
        self.note(f"loaded text from {arg} ({len(text)} characters): it goes in front of your next message")

    def _save(self, arg: str) -> None:
        if self.conversation.template is None:
            raise UsageError("/save needs a chat template (without one, -i -no-cnv feeds text as it is)")
        commands.save(self.conversation.messages, arg)
        self.note(f"saved {len(self.conversation.messages)} message(s) to {arg}")

    def _load(self, arg: str) -> None:
        messages = commands.load(arg)
        with sigint_stops() as interrupt:
            n = self.conversation.load(messages, self.timings, interrupt)
        self.prefix = ""
        self.note(f"loaded {len(messages)} message(s) from {arg} ({n} tokens fed)")

    def _media(self, name: str, arg: str) -> None:
        self.conversation.attach(name, arg)
        self.note(f"loaded {name[1:]} {arg}: it goes with your next message")

    def _exit(self, _arg: str) -> str:
        return EXIT


_HANDLERS = {"/help": Session._help, "/clear": Session._clear, "/regen": Session._regen, "/read": Session._read,
             "/save": Session._save, "/load": Session._load, "/exit": Session._exit,
             "/image": lambda s, arg: s._media("/image", arg), "/video": lambda s, arg: s._media("/video", arg)}


def _is_command_line(line: str) -> bool:
    return line.split(None, 1)[:1] != [] and line.split(None, 1)[0].startswith("/") and \
        not line.lstrip().startswith("//")


def _read(reader: LineReader, out: TextIO) -> str | None:
    try:
        return reader.read()
    except KeyboardInterrupt as exc:  # end the prompt's line first
        out.write("\n")
        out.flush()
        if getattr(exc, "signum", signal.SIGINT) == signal.SIGINT:
            raise PromptExit() from None  # Ctrl-C at the prompt: the normal way out (llama-cli's)
        raise  # SIGTERM, SIGHUP: the documented interrupted line


def converse(conversation: Conversation, first: str | None, reader: LineReader, out: TextIO,
             timings: Timings, single_turn: bool = False) -> None:
    """Turns until /exit or the end of input (or one reply with `single_turn`); Ctrl-C during a
    reply ends that reply only, Ctrl-C at the prompt raises PromptExit."""
    session = Session(conversation, out, timings)
    if first is not None and session.run_line(first, message_only=True) == TURN and single_turn:
        return
    while True:
        line = _read(reader, out)
        if line is None:
            if reader.terminal:
                out.write("\n")  # the end of input left the cursor after the prompt
            return
        done = session.run_line(line)
        if done == EXIT or (done == TURN and single_turn):
            return


def banner(conversation: Conversation, system: str | None, template_line: str) -> list[str]:
    """What this mode does and its commands (stderr)."""
    chat = conversation.template is not None
    names = ", ".join(commands.command_names(conversation.encoder is not None))
    lines = [template_line] if chat else []
    lines += ["== Conversation: each input is a user message, rendered with the chat template ==" if chat else
              "== Interactive: each input is fed to the model as it is ==",
              " - end a line with '\\' to go on on the next one; Ctrl+C interrupts a reply",
              " - /exit, the end of input (Ctrl+D) or Ctrl+C at the prompt ends the conversation",
              f" - commands: {names} (/help says what each does)"]
    if chat and not conversation.options.inline and _thinks(conversation):
        lines.append(f" - the model's thinking is shown between {START_THINKING} and {END_THINKING}, its answer "
                     "after (--reasoning-format none: inline)")
    if chat and system is None:
        lines.append(" - no system message (-sys PROMPT sets one)")
    return lines


def _thinks(conversation: Conversation) -> bool:
    """Whether the template's generation prompt opens the think channel."""
    try:
        prompt = conversation.template.render([{"role": "user", "content": "."}], add_generation_prompt=True)
    except UsageError:  # a template that needs more than this: the first turn will say
        return False
    return reply_start(prompt) == "think"


def run_interactive(conversation: Conversation, first: str | None, system: str | None, template_line: str,
                    timings: Timings, log: Callable[[Sequence[str]], None], single_turn: bool = False) -> None:
    if conversation.template is not None and system is not None:
        conversation.messages.append({"role": "system", "content": system})
    log(banner(conversation, system, template_line))
    converse(conversation, first, LineReader(sys.stdin, sys.stdout), sys.stdout, timings, single_turn)
