"""The chat template a kimi-k3 GGUF carries in `tokenizer.chat_template`, and the one sandbox it
is compiled in (the converter checks it, the runner renders with it).

A checkpoint that ships a template (`chat_template.jinja`, or `chat_template` in
tokenizer_config.json) keeps its own. K3 ships none: Moonshot renders chats in Python. For it the
converter writes `K3_CHAT_TEMPLATE`, written here for K3's chat format (docs/reference/gguf.md#tokenizer), so that
llama.cpp-style runtimes find a template where they look for one.

K3's format ("XTML"): every element is `<|open|>NAME attr="value"...<|sep|> body <|close|>NAME<|sep|>`,
attribute values escaped `&` -> `&amp;`, `"` -> `&quot;`. A turn is a `message` element with a `role`
attribute (and `name` when the message has one), followed by `<|end_of_msg|>`, the token that
ends a turn (the GGUF's EOS). An assistant turn holds a `think` channel (thinking mode only) and a
`response` channel. With thinking on (the default, as in Moonshot's renderer), the conversation
starts with a system message of type `thinking-effort` naming the effort (`max` by default). The
generation prompt opens an assistant message and its first channel, which the model closes.

The built-in template covers text conversations (system, user, assistant turns; `content` a
string or a list of parts; `reasoning_content` of past assistant turns) with images and clips: an
`image` part (with the image's original `width` and `height`) or a `video` part becomes K3's media
block as Moonshot's image processor writes it into the user's text,
`<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>` (a clip:
`<|media_begin|>video<|media_content|>...`), whose one `<|media_pad|>` the runtime replaces by the
item's rows. Tool declarations, tool calls and other parts raise an error naming what is not
supported, rather than being dropped.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import TokenizerError
from ..io.jsonfile import not_unicode, read_json, read_text
from .template_sandbox import compile_template, render

TEMPLATE_FILE = "chat_template.jinja"

K3_CHAT_TEMPLATE = r"""
{#- Kimi K3 chat format (XTML); see gguf_arch/chat_template.py in kimi-k3-gguf. -#}
{%- set think = true if thinking is not defined else thinking -%}
{%- set effort = 'max' if thinking_effort is not defined else thinking_effort -%}
{%- macro attr_value(v) -%}{{ v | string | replace('&', '&amp;') | replace('"', '&quot;') }}{%- endmacro -%}
{%- macro opening(name, attrs) -%}
<|open|>{{ name }}{% for key, value in attrs %} {{ key }}="{{ attr_value(value) }}"{% endfor %}<|sep|>
{%- endmacro -%}
{%- macro closing(name) -%}<|close|>{{ name }}<|sep|>{%- endmacro -%}
{%- macro element(name, attrs=[]) -%}{{ opening(name, attrs) }}{{ caller() }}{{ closing(name) }}{%- endmacro -%}
{%- macro turn(attrs) -%}{% set body = caller() %}{% call element('message', attrs) %}{{ body }}{% endcall %}<|end_of_msg|>{%- endmacro -%}
{%- macro text_of(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{ content }}
{%- else -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{ part.text }}
{%- elif part.type in ['image', 'video'] -%}
{%- if part.type == 'image' and (part.width is not defined or part.height is not defined) -%}{{ raise_exception('an image part needs its width and height (the media block names the original size)') }}{%- endif -%}
<|media_begin|>{{ 'video' if part.type == 'video' else 'image ' ~ part.width ~ 'x' ~ part.height }}<|media_content|><|media_pad|><|media_end|>
{%- else -%}{{ raise_exception('the built-in Kimi K3 template renders text, image and video parts, not ' ~ part.type) }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools is defined and tools -%}{{ raise_exception('the built-in Kimi K3 template has no tool declarations') }}{%- endif -%}
{%- if think and effort is not none -%}
{%- if effort not in ['low', 'medium', 'high', 'max'] -%}{{ raise_exception('thinking_effort must be low, medium, high or max, not ' ~ effort) }}{%- endif -%}
{%- call turn([('role', 'system'), ('type', 'thinking-effort')]) -%}
`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.
Now the system is invoked with `thinking_effort={{ effort }}`.
{%- endcall -%}
{%- endif -%}
{%- for m in messages -%}
{%- set attrs = [('role', m.role)] + ([('name', m.name)] if m.name else []) -%}
{%- if m.role in ['system', 'user'] -%}
{%- call turn(attrs) -%}{{ text_of(m.content) }}{%- endcall -%}
{%- elif m.role == 'assistant' -%}
{%- if m.tool_calls -%}{{ raise_exception('the built-in Kimi K3 template has no tool calls') }}{%- endif -%}
{%- call turn(attrs) -%}
{%- if think -%}{%- call element('think') -%}{{ m.reasoning_content if m.reasoning_content and m.reasoning_content | trim }}{%- endcall -%}{%- endif -%}
{%- call element('response') -%}{{ text_of(m.content) }}{%- endcall -%}
{%- endcall -%}
{%- else -%}{{ raise_exception('the built-in Kimi K3 template has no role ' ~ m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ opening('message', [('role', 'assistant')]) }}{{ opening('think' if think else 'response', []) }}{%- endif -%}
"""


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
