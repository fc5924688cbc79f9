"""K3's chat markup ("XTML"): its four marker tokens, the element names a reply is made of, and the
escaping of attribute values. The chat template writes this format, the runtime's reply parser and
grammars read it (docs/reference/chat-format.md).

An element is `<|open|>NAME k1="v1" k2="v2"<|sep|>` body `<|close|>NAME<|sep|>`. Only the markers
are special tokens; element names and attributes are ordinary text, so prose containing the word
"think" is never markup. A turn is a `message` element followed by `<|end_of_msg|>`.
"""
from __future__ import annotations

import re

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)

# The elements of an assistant turn, in the order the model writes them.
MESSAGE = "message"
THINK = "think"
RESPONSE = "response"
TOOLS = "tools"
CALL = "call"
ARGUMENT = "argument"
JSON_BLOCK = "json"

# An argument's `type` attribute: the JSON type of its value. A `string` value is written raw, any
# other as JSON.
ARGUMENT_TYPES = ("string", "number", "boolean", "null", "object", "array")

_ATTR = re.compile(r'\s+([^\s=]+)="([^"]*)"')
_UNESCAPE = {"&amp;": "&", "&quot;": '"'}


def escape_attr(value: str) -> str:
    """An attribute value as the template writes it: `&` and `"` escaped."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return re.sub(r"&amp;|&quot;", lambda m: _UNESCAPE[m.group()], value)


def opening(name: str, **attrs: str) -> str:
    """`<|open|>NAME k="v"...<|sep|>`, attributes in the order given."""
    return OPEN + name + "".join(f' {k}="{escape_attr(str(v))}"' for k, v in attrs.items()) + SEP


def closing(name: str) -> str:
    return CLOSE + name + SEP


def parse_tag(text: str) -> tuple[str, dict[str, str]] | None:
    """A tag's name and attributes from what lies between a marker and `<|sep|>`
    (`call tool="x" index="1"`); None when it is not a well-formed tag."""
    name, _, rest = text.partition(" ")
    if not name or any(c in name for c in '"=<>'):
        return None
    rest = " " + rest if rest else ""
    attrs, pos = {}, 0
    for m in _ATTR.finditer(rest):
        if m.start() != pos:
            return None
        attrs[m.group(1)] = unescape_attr(m.group(2))
        pos = m.end()
    return (name, attrs) if pos == len(rest) else None
