"""How kimi-k3-cli shows a chat reply as it streams: the thinking apart from the answer.

A K3 reply starts in its think channel (the generation prompt opens it). The reply parser
(chat/reply.py) splits what the model writes into reasoning, content and tool calls; the thinking
is printed between llama-cli's markers (its cli-ui.h), greyed with ANSI when stdout is a terminal,
and the answer after it:

    [Start thinking]
    ...the reasoning...
    [End thinking]

    ...the answer...

A reply cut while thinking (-n, Ctrl-C) ends without the closing marker, as llama-cli leaves it.
With --reasoning-format none the reply is printed as it comes, the thinking inline as its text and
no markers (the runner's output before the think channel was told apart). Tool-call sections are
never printed as text.
"""
from __future__ import annotations

from typing import TextIO

from ..chat.reply import Delta, ParsedReply, ReplyParser
from ..generation.events import Reply
from ..text.tokenizer import BPETokenizer

START_THINKING, END_THINKING = "[Start thinking]", "[End thinking]"
GREY, RESET = "\x1b[90m", "\x1b[0m"  # llama-cli's colour for reasoning (DISPLAY_TYPE_REASONING)


class ReplyView:
    """One reply's parser (its `show` is the generator's) and what it prints."""

    def __init__(self, tokenizer: BPETokenizer, start: str, inline: bool, color: bool) -> None:
        # The think channel counts as shown text, so that the reply's text (and the reverse prompts
        # looking at it) is the same whichever way it is displayed.
        self.parser = ReplyParser(tokenizer, start, reasoning_in_content=True)
        self._inline, self._color = inline, color
        self._thinking = False  # between the markers
        self._ended_line = True  # the last text printed ended with a newline

    def show(self, token: int) -> bool:
        return self.parser.feed(token)

    def stream(self, generation, out: TextIO) -> tuple[Reply, ParsedReply]:
        """Print a generation as it comes; its reply and the parsed reply."""
        try:
            for event in generation:
                self._print(out, event.text)
            parsed = self.parser.finish()
            self._print(out, "")  # what finish() released (the end of an incomplete character)
        finally:
            if self._thinking and self._color:
                out.write(RESET)  # a cut reply, or an error: the terminal is not left grey
                out.flush()
        return generation.reply, parsed

    def _print(self, out: TextIO, text: str) -> None:
        deltas = self.parser.take()
        if self._inline:
            out.write(text)
        else:
            for d in deltas:
                self._delta(out, d)
        out.flush()

    def _delta(self, out: TextIO, d: Delta) -> None:
        if d.kind == "reasoning" and d.text:
            if not self._thinking:
                self._thinking = True
                self._write(out, (GREY if self._color else "") + START_THINKING + "\n")
            self._write(out, d.text)
        elif d.kind == "content" and d.text:
            if self._thinking:
                self._thinking = False
                closing = ("" if self._ended_line else "\n") + END_THINKING + (RESET if self._color else "")
                self._write(out, closing + "\n\n")
            self._write(out, d.text)
        # call / arguments deltas: a tool call is not text of the reply

    def _write(self, out: TextIO, text: str) -> None:
        out.write(text)
        self._ended_line = text.endswith("\n")
