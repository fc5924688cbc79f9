"""Chat templates: the Jinja template of a GGUF (or a file) rendered as Hugging Face renders it,
in a bounded sandbox (time, sizes, depth); the CLI's conversations and the server's chat requests
both use it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE
from gguf_arch.arch.template_sandbox import compile_template, render
from gguf_arch.io.console import UsageError

from .tokenizer import BPETokenizer

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# K3's XTML markup: what lies between an opening or closing token and the next <|sep|> is a tag
# name and attributes, not text of the reply.


# The variables every rendering gets from the model and the caller: a template kwarg of the same
# name (--chat-template-kwargs, a request's chat_template_kwargs) would collide with them.
RESERVED_KWARGS = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def reserved_kwargs(names: Iterable[str]) -> list[str]:
    """Those of `names` that a template kwarg may not set (RESERVED_KWARGS), in that order."""
    given = set(names)
    return [k for k in RESERVED_KWARGS if k in given]


class ChatTemplate:
    """A chat template compiled in the bounded sandbox (gguf_arch/arch/template_sandbox.py),
    rendered as Hugging Face renders it: any failure, a bound included, is one line naming it."""

    def __init__(self, text: str, where: str, tokenizer: BPETokenizer, kwargs: Mapping[str, Any]) -> None:
        self.where, self.text = where, text
        self._template = compile_template(text, where, UsageError)
        special = lambda i: tokenizer.decode([i]) if i is not None else ""  # noqa: E731
        self._context = {"bos_token": special(tokenizer.bos_id), "eos_token": special(tokenizer.eos_id),
                         **kwargs}

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        """kwargs: template variables for this rendering only (a server request's
        chat_template_kwargs), over those given at construction."""
        return render(self._template, self.where, UsageError, messages=list(messages),
                      add_generation_prompt=add_generation_prompt, **{**self._context, **kwargs})


def chat_template(metadata: Mapping[str, Any], tokenizer: BPETokenizer, file: tuple[Path | str, str] | None,
                  kwargs: Mapping[str, Any], gguf: Path | str = "the GGUF") -> tuple[ChatTemplate, str]:
    """--chat-template-file (its path and text, read before loading), else the GGUF's
    tokenizer.chat_template, else the built-in K3 template; with a line saying which."""
    if file is not None:
        return ChatTemplate(file[1], str(file[0]), tokenizer, kwargs), f"chat template: {file[0]}"
    text = metadata.get(CHAT_TEMPLATE_KEY)
    if isinstance(text, str):
        return (ChatTemplate(text, f"{gguf}: {CHAT_TEMPLATE_KEY}", tokenizer, kwargs),
                f"chat template: the GGUF's {CHAT_TEMPLATE_KEY}")
    return (ChatTemplate(K3_CHAT_TEMPLATE, "built-in K3 template", tokenizer, kwargs),
            f"chat template: the GGUF has no {CHAT_TEMPLATE_KEY}; using the built-in K3 template")


# Input marking: a special token's spelling inside a request's own strings (a message, a tool's
# arguments, a schema) is text, never the token; only the template's own markup is. The strings are
# marked before rendering (each spelling wrapped in two noncharacters, which every filter a template
# applies keeps) and the rendering is tokenized span by span (llama.cpp's own Jinja engine marks
# input strings for the same reason: its "input marking").
MARK_START, MARK_END = "\U0010fffe", "\U0010ffff"


def mark_input(value: Any, tokenizer: BPETokenizer) -> Any:
    """`value` (strings, lists, mappings) with every special token's spelling marked as text."""
    if isinstance(value, str):
        return tokenizer.special_pattern.sub(lambda m: MARK_START + m.group() + MARK_END, value) \
            if tokenizer.special_pattern is not None else value
    if isinstance(value, list):
        return [mark_input(v, tokenizer) for v in value]
    if isinstance(value, dict):
        return {k: mark_input(v, tokenizer) for k, v in value.items()}
    return value


def has_marks(value: Any) -> bool:
    """Whether a request's strings already hold the marks (they are refused: they would be taken
    for marks)."""
    if isinstance(value, str):
        return MARK_START in value or MARK_END in value
    if isinstance(value, list):
        return any(has_marks(v) for v in value)
    if isinstance(value, dict):
        return any(has_marks(k) or has_marks(v) for k, v in value.items())
    return False


def encode_marked(text: str, tokenizer: BPETokenizer) -> list[int]:
    """Token ids of a rendering of marked input: special tokens parsed outside the marks only
    (and the BOS first when the GGUF asks for one, as `encode` adds it)."""
    ids: list[int] = tokenizer.encode("") if tokenizer.add_bos else []
    for i, chunk in enumerate(text.split(MARK_START)):
        inside, _, outside = chunk.partition(MARK_END) if i else ("", "", chunk)
        ids += tokenizer.encode(inside, add_bos=False, allow_special=False) if inside else []
        ids += tokenizer.encode(outside, add_bos=False) if outside else []
    return ids


def unmark(text: str) -> str:
    return text.replace(MARK_START, "").replace(MARK_END, "")
