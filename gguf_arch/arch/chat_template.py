"""The chat template a kimi-k3 GGUF carries in `tokenizer.chat_template`, and the one sandbox it
is compiled in (the converter checks it, the runner renders with it).

A checkpoint that ships a template (`chat_template.jinja`, or `chat_template` in
tokenizer_config.json) keeps its own. K3 ships none: Moonshot renders chats in Python. For it the
converter writes `K3_CHAT_TEMPLATE`, the project's template of K3's chat format ("XTML"), so that
llama.cpp-style runtimes find a template where they look for one. Its text is the package data
file k3_chat_template.jinja beside this module; docs/reference/chat-format.md says what it renders.

In short: every element is `<|open|>NAME attr="value"...<|sep|> body <|close|>NAME<|sep|>`
(gguf_arch/arch/xtml.py holds the markup's facts), a turn is a `message` element followed by
`<|end_of_msg|>` (the GGUF's EOS). The prompt holds the tool declarations (`tools`, keys sorted),
the thinking-effort message (thinking on, the default; `thinking_effort`, `max` by default), the
conversation (system and user turns with text, image and video parts; assistant turns with their
`think` channel, `response` channel and tool calls; tool results named by id, name or position),
the tool-choice and response-format messages (`tool_choice`, `response_format`), and the
generation prompt, which opens the assistant's turn and its first channel.

It renders byte for byte as llama.cpp's own K3 template (models/templates/Kimi-K3.jinja) in
Python's Jinja2 and in llama.cpp's C++ engine, except where it refuses what llama.cpp drops or
guesses (a role other than system, user, assistant and tool; a part type it cannot render; a named
tool_choice) and where it takes `medium` effort, which llama.cpp refuses.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import TokenizerError
from ..io.jsonfile import not_unicode, read_json, read_text
from .template_sandbox import compile_template, render

TEMPLATE_FILE = "chat_template.jinja"

# The template's text lives beside this module (package data), where it reads as Jinja.
TEMPLATE_SOURCE = Path(__file__).with_name("k3_chat_template.jinja")
K3_CHAT_TEMPLATE = TEMPLATE_SOURCE.read_text(encoding="utf-8")


def _from_tokenizer_config(path: Path) -> str | None:
    if not path.is_file():
        return None
    raw = read_json(path, TokenizerError, "not found")
    value = raw.get("chat_template") if isinstance(raw, dict) else None
    if isinstance(value, list):  # [{"name": ..., "template": ...}]: Hugging Face's named templates
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{path}: chat_template must be a string or a list with a 'default' template")
    if value is not None and not_unicode(value) is not None:  # half a surrogate pair: no GGUF string holds it
        raise TokenizerError(f"{path}: 'chat_template' is not valid Unicode (a lone surrogate escape such as \\ud800)")
    return value


def checkpoint_chat_template(model_dir: Path, tokenizer_config: Path) -> tuple[str, Path] | None:
    """The checkpoint's own template and the file it is in: chat_template.jinja first, as
    transformers reads it, then tokenizer_config.json's chat_template; None when it has neither."""
    jinja_file = Path(model_dir) / TEMPLATE_FILE
    if jinja_file.exists():
        return read_text(jinja_file, TokenizerError, "not found"), jinja_file
    text = _from_tokenizer_config(tokenizer_config)
    return None if text is None else (text, tokenizer_config)


# A conversation every chat template renders: user and assistant alternate, no system message
# (some templates refuse one), and a generation prompt after the last user turn.
SAMPLE_CONVERSATION = ({"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello! How can I help?"},
                       {"role": "user", "content": "Name a colour."})


def gguf_chat_template(model_dir: Path, tokenizer_config: Path, bos: str = "", eos: str = "") -> str:
    """What the converter writes to tokenizer.chat_template: compiled, and rendered once on
    SAMPLE_CONVERSATION, so that a template that fails (a runtime error, a bound) is refused here,
    naming its file, rather than written into a GGUF for every runtime to trip on."""
    own = checkpoint_chat_template(model_dir, tokenizer_config)
    text, where = (K3_CHAT_TEMPLATE, "built-in K3 template") if own is None else (own[0], str(own[1]))
    template = compile_template(text, where, TokenizerError)
    render(template, where, TokenizerError, messages=list(SAMPLE_CONVERSATION), add_generation_prompt=True,
           bos_token=bos, eos_token=eos)
    return text
