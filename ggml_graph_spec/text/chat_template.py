"""Chat templates: the Jinja template of a GGUF (or a file) rendered as Hugging Face renders it,
in Jinja's sandbox; the CLI's conversations and the server's chat requests both use it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jinja2

from gguf_arch.arch.chat_template import K3_CHAT_TEMPLATE, compile_template
from gguf_arch.io.console import UsageError

from .tokenizer import BPETokenizer

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# K3's XTML markup: what lies between an opening or closing token and the next <|sep|> is a tag
# name and attributes, not text of the reply.
_TAG_START = ("<|open|>", "<|close|>")
_TAG_END = "<|sep|>"


class ChatTemplate:
    """A chat template compiled in the sandbox, rendered as Hugging Face renders it."""

    def __init__(self, text: str, where: str, tokenizer: BPETokenizer, kwargs: Mapping[str, Any]) -> None:
        self.where = where
        self._template = compile_template(text, where, UsageError)
        special = lambda i: tokenizer.decode([i]) if i is not None else ""  # noqa: E731
        self._context = {"bos_token": special(tokenizer.bos_id), "eos_token": special(tokenizer.eos_id),
                         **kwargs}

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        """kwargs: template variables for this rendering only (a server request's
        chat_template_kwargs), over those given at construction."""
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **{**self._context, **kwargs})
        except jinja2.TemplateError as exc:  # raise_exception, sandbox violations, undefined names
            raise UsageError(f"{self.where}: chat template: {exc.message or exc}") from None
        except RecursionError:  # a macro calling itself without end
            raise UsageError(f"{self.where}: chat template: recursion too deep") from None


def chat_template(metadata: Mapping[str, Any], tokenizer: BPETokenizer, file: Path | None,
                  kwargs: Mapping[str, Any], read_text: Callable[[Path], str]) -> tuple[ChatTemplate, str]:
    """--chat-template-file, else the GGUF's tokenizer.chat_template, else the built-in K3 template;
    with a line saying which."""
    if file is not None:
        return ChatTemplate(read_text(file), str(file), tokenizer, kwargs), f"chat template: {file}"
    text = metadata.get(CHAT_TEMPLATE_KEY)
    if isinstance(text, str):
        return ChatTemplate(text, CHAT_TEMPLATE_KEY, tokenizer, kwargs), f"chat template: the GGUF's {CHAT_TEMPLATE_KEY}"
    return (ChatTemplate(K3_CHAT_TEMPLATE, "built-in K3 template", tokenizer, kwargs),
            f"chat template: the GGUF has no {CHAT_TEMPLATE_KEY}; using the built-in K3 template")


class ReplyFilter:
    """Which tokens of a chat reply are shown: no special tokens, no XTML tag names or attributes."""

    def __init__(self, tokenizer: BPETokenizer) -> None:
        self._tokenizer = tokenizer
        self._starts = {i for i in map(tokenizer.special_id, _TAG_START) if i is not None}
        self._end = tokenizer.special_id(_TAG_END)
        self._in_tag = False

    def __call__(self, token: int) -> bool:
        if token in self._starts:
            self._in_tag = True
        elif token == self._end:
            self._in_tag = False
            return False
        return not (self._in_tag or self._tokenizer.is_special(token))
