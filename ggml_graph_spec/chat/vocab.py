"""The runtime tokenizer as llguidance sees it: every token's bytes, special tokens marked.

llguidance takes a vocabulary as raw token bytes and marks a special token by a leading 0xFF
byte (which no UTF-8 text holds). So a special token is given as 0xFF + its name, and an ordinary
token of several bytes that itself starts with 0xFF (a merge of the raw byte) is given with 0xFE
in its place: llguidance would take it for a special token otherwise, and since neither byte is
ever UTF-8, no grammar's text can tell the two apart (bench/grammar_libs.py measured the trap).
The single byte 0xFF is passed as it is: llguidance reads a one-byte 0xFF token as that byte.

Built once per tokenizer (about half a second at K3's 163,840 tokens) and shared by every
request's grammar.
"""
from __future__ import annotations

import threading
import weakref

from ..text.tokenizer import BPETokenizer

SPECIAL_MARK = b"\xff"
STAND_IN = b"\xfe"  # an ordinary token's leading 0xFF, as llguidance is given it
_cache: "weakref.WeakKeyDictionary[BPETokenizer, object]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _Wrapped:
    """What llguidance.TokenizerWrapper reads: tokens, special ids, EOS and a tokenize call."""

    def __init__(self, tok: BPETokenizer) -> None:
        self.tokens = [self._bytes(tok, i) for i in range(tok.vocab_size)]
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else 0
        self.bos_token_id = tok.bos_id
        self._tok = tok

    @staticmethod
    def _bytes(tok: BPETokenizer, i: int) -> bytes:
        data = tok.token_bytes(i)
        if tok.is_special(i):
            return SPECIAL_MARK + data
        if data.startswith(SPECIAL_MARK) and len(data) > 1:
            return STAND_IN + data[1:]
        return data

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        return self._tok.encode(s, add_bos=False, allow_special=False)


def ll_tokenizer(tok: BPETokenizer):
    """The llguidance tokenizer of `tok`, made on first use."""
    import llguidance  # the grammar engine is needed only by constrained requests

    with _lock:
        cached = _cache.get(tok)
        if cached is None:
            cached = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(tok)))
            _cache[tok] = cached
        return cached
