"""What a request body may be as JSON, decided once for every endpoint:

* UTF-8 JSON (a 400 `not valid JSON` otherwise), every string valid Unicode (no lone surrogate
  escape: a 400 naming where);
* nested at most MAX_DEPTH objects and arrays deep: a 400 `nested deeper than 64 levels` (a
  tool's JSON schema needs a few levels; a hostile body a stack's worth);
* each key once per object: a 400 naming the key. Parsers disagree on which of two values
  counts (Python's json takes the last, others the first), so a body with both could mean one
  thing to a proxy that checked it and another to this server.

A client that closes its connection before its body has arrived gets nothing (it is not
there to read it) and its request is never queued: `ClientGone`, answered by no one.
"""
from __future__ import annotations

import json
from typing import Any

from gguf_arch.io.jsonfile import not_unicode

from .errors import INVALID_REQUEST, ApiError, bad_request

MAX_DEPTH = 64
GONE = 499  # nginx's "client closed request": never sent, only logged as the request's end


class ClientGone(ApiError):
    """The client closed its connection while its body was still arriving."""

    def __init__(self) -> None:
        super().__init__(GONE, INVALID_REQUEST, "the client closed its connection before its body arrived")


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _Duplicate(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _depth(value: Any) -> int:
    """The nesting depth of a parsed JSON value (a scalar 0, [] 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        if d <= MAX_DEPTH:  # past the bound the answer is known
            stack.extend((item, d + 1) for item in items)
    return deepest


def _too_deep() -> ApiError:
    return bad_request(f"the request body is nested deeper than {MAX_DEPTH} levels of objects and arrays")


def parse(body: bytes) -> Any:
    """The body as JSON under the rules above."""
    try:
        value = json.loads(body, object_pairs_hook=_unique)
    except _Duplicate as dup:
        shown = dup.key.encode("utf-8", "backslashreplace").decode()[:80]
        raise bad_request(f"the request body has the key {shown!r} twice in one object; each key may appear "
                          "once") from None
    except RecursionError:  # json.loads' own bound, far past ours
        raise _too_deep() from None
    except ValueError as exc:  # not JSON, not UTF-8
        raise bad_request(f"the request body is not valid JSON ({str(exc)[:120]})") from None
    if _depth(value) > MAX_DEPTH:
        raise _too_deep()
    where = not_unicode(value)
    if where is not None:
        raise bad_request(f"'{where or 'the request body'}' is not valid Unicode (a lone surrogate escape such as "
                          "\\ud800)")
    return value


def text(value: Any, where: str) -> str:
    """A field that must be text (a block's text, a reasoning item's), else a 400 naming it; the
    adapters of the Responses and Messages APIs join such pieces, which must not be numbers."""
    if not isinstance(value, str):
        raise bad_request(f"'{where}' must be a string, got {type(value).__name__}")
    return value
