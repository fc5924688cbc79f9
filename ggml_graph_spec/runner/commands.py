"""The commands of kimi-k3-cli's conversation: llama-cli's (/clear, /regen, /read, /image, /video,
/exit) and /help, /save, /load.

An input line whose first word is a slash and a name is a command, never a message: an unknown
one is refused with a hint, a line starting with `//` is the message that starts with one `/`.
/read puts a file's text in front of the next message, under llama-cli's header
(`--- File: NAME ---`, its cli-context.cpp). /save writes the conversation as a JSON list of
OpenAI-style messages (role, content, and an assistant's reasoning_content); /load reads such a
list (or an object holding it as "messages", a request body), checked field by field.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf_arch.io.atomic import write_atomically
from gguf_arch.io.console import UsageError
from gguf_arch.io.jsonfile import not_unicode, read_json, read_text


@dataclass(frozen=True)
class Command:
    name: str
    arg: str  # what it takes ("": nothing)
    what: str
    media: bool = False  # only with --mmproj


COMMANDS = (
    Command("/help", "", "list these commands"),
    Command("/clear", "", "forget the conversation (its system message stays): the model's caches are reset"),
    Command("/regen", "", "drop the last reply and generate it again from the same state"),
    Command("/read", "FILE", "put FILE's text in front of your next message"),
    Command("/save", "FILE", "write the conversation to FILE as JSON messages"),
    Command("/load", "FILE", "restore a conversation that /save wrote, and feed it to the model"),
    Command("/image", "FILE", "an image for your next message", media=True),
    Command("/video", "F0,F1,...", "the frames of a clip for your next message", media=True),
    Command("/exit", "", "end the conversation (so do the end of input, Ctrl+D, and Ctrl+C at the prompt)"),
)
BY_NAME = {c.name: c for c in COMMANDS}
_COMMAND_WORD = re.compile(r"/[A-Za-z][A-Za-z0-9_-]*")
SAVED_FIELDS = ("role", "content", "reasoning_content", "name")
ROLES = ("system", "user", "assistant")


def parse_command(line: str) -> tuple[Command, str] | None:
    """The command of an input line and its argument; None for a message. UsageError for a
    command that is not one of COMMANDS, or given the wrong argument."""
    word, arg = (line.split(None, 1) + ["", ""])[:2]
    if not _COMMAND_WORD.fullmatch(word):
        return None  # a message, `//...` included
    command = BY_NAME.get(word)
    if command is None:
        raise UsageError(f"unknown command {word}: /help lists them (a message starting with '/': type '//')")
    arg = arg.strip()
    if command.arg and not arg:
        raise UsageError(f"{word} needs {command.arg}: {word} {command.arg}")
    if arg and not command.arg:
        raise UsageError(f"{word} takes no argument")
    return command, arg


def message_text(line: str) -> str:
    """A message line as the model gets it: `//...` is the text `/...`."""
    head = len(line) - len(line.lstrip())
    return line[:head] + line[head + 1:] if line.startswith("//", head) else line


def help_lines(media: bool) -> list[str]:
    rows = [(f"{c.name} {c.arg}".strip(), c.what) for c in COMMANDS if media or not c.media]
    rows.append(("//TEXT", "the message /TEXT (one that starts with a slash)"))
    width = max(len(r[0]) for r in rows)
    return [f"  {left:<{width}}  {right}" for left, right in rows]


def command_names(media: bool) -> list[str]:
    return [c.name for c in COMMANDS if media or not c.media]


def file_text(arg: str) -> str:
    """/read FILE: the text that goes in front of the next message (llama-cli's header, and a
    newline after a file that does not end with one, so that the message starts on its own line)."""
    text = read_text(Path(arg), UsageError, "no such file")
    return f"--- File: {arg} ---\n{text}" + ("" if text.endswith("\n") or not text else "\n")


def save(messages: list[dict[str, Any]], arg: str) -> None:
    """/save FILE: the messages as JSON, written whole or not at all."""
    if any(not isinstance(m.get("content"), str) for m in messages):
        raise UsageError("/save: the conversation holds images or clips, and a saved conversation is text only")
    data = json.dumps(messages, ensure_ascii=False, indent=1) + "\n"
    try:
        write_atomically(Path(arg), lambda tmp: tmp.write_text(data, encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"{arg}: cannot be written ({exc.strerror or exc})") from None


def load(arg: str) -> list[dict[str, Any]]:
    """/load FILE: the saved messages, checked."""
    value = read_json(Path(arg), UsageError, "no such file")
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list):
        raise UsageError(f"{arg}: expected a JSON list of messages, as /save writes one")
    for i, m in enumerate(value):
        _check_message(m, f"{arg}: messages[{i}]")
    where = not_unicode(value)
    if where is not None:
        raise UsageError(f"{arg}: {where} is not valid Unicode (a lone surrogate escape such as \\ud800)")
    return value


def _check_message(m: Any, at: str) -> None:
    if not isinstance(m, dict):
        raise UsageError(f"{at} is not an object")
    if m.get("role") not in ROLES:
        raise UsageError(f"{at}.role must be one of {', '.join(ROLES)}, got {json.dumps(m.get('role'))}")
    if "content" not in m:
        raise UsageError(f"{at} has no content")
    for key, value in m.items():
        if key not in SAVED_FIELDS:
            raise UsageError(f"{at}: '{key}' is not a field of a saved message ({', '.join(SAVED_FIELDS)})")
        if not isinstance(value, str):
            raise UsageError(f"{at}.{key} must be a string (a saved conversation is text only)")
