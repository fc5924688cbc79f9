"""Ending in time: a reply under a grammar that nears its token limit (max_tokens, or the context)
is steered to a valid end instead of being cut mid-structure.

While the room left is at most MAX_LOOKAHEAD tokens, each step looks ahead on a copy of the
matcher: how many tokens the closing policy takes from here to the grammar's end (`shortest`).
The closing policy takes what the grammar forces (llguidance's canonical tokens of a required
name, say), else the first allowed of CLOSERS, else the lowest allowed id that is not whitespace
(a single byte; JSON's optional blanks are the lowest ids and would fill the way), else the lowest
allowed. Then:

* once the room is down to that count (and SLACK), every token is the closing policy's own, the
  very way the look-ahead counted: text the grammar requires but does not spell is its lowest
  allowed token too (a pattern's smallest character, say), since the weights could repeat an
  unbounded part (`[a-z]+` before a required `@`) past any room;
* before that, an allowed token of OPENERS (`<|open|>`, `{`, `[`, `,`, `"`) that would make the
  end unreachable in the room left is not allowed: a new call or object is started only if it
  can still be finished.

Looking ahead costs a few mask computations per token of the way; it is skipped while the room
is so much larger than the way that no token could close the gap before the next look-ahead (one
token adds at most the largest structure an opener was seen to start, or the whole way's length
before any was measured).

So strings close, structures close and required parts are written shortest-first, whatever the
weights; a reply ends "length" only when even its shortest end did not fit when the look-ahead
began. Outside its last MAX_LOOKAHEAD tokens a reply is never touched by this.
"""
from __future__ import annotations

import numpy as np

from gguf_arch.arch import xtml

from ..text.tokenizer import BPETokenizer

# `"` before `}`: inside a string `}` is only a character; outside one, `"` opens a declared key or
# a string value, both finite (grammar.py closes objects to their declared properties). `,` before
# `0`: a number the weights began never grows digit by digit.
CLOSERS = (xtml.END_OF_MSG, xtml.CLOSE, xtml.SEP, '"', "}", "]", ",", ":", "0")
OPENERS = (xtml.OPEN, "{", "[", ",", '"')
MAX_LOOKAHEAD = 256  # the room (tokens) from which a reply looks ahead
SLACK = 2  # tokens of room kept beyond the look-ahead's count


def _ids(tokenizer: BPETokenizer, texts: tuple[str, ...]) -> list[int]:
    """`texts` as single tokens of this vocabulary (those it spells with one token)."""
    ids = []
    for text in texts:
        found = tokenizer.special_id(text)
        if found is None:
            one = tokenizer.encode(text, add_bos=False, allow_special=False)
            found = one[0] if len(one) == 1 else None
        if found is not None:
            ids.append(found)
    return ids


class Bits:
    """A matcher's mask as llguidance writes it: one bit per token."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.words = np.zeros((n + 31) // 32, dtype=np.int32)

    def fill(self, matcher) -> "Bits":
        matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        return self

    def __contains__(self, token: int) -> bool:
        return bool((int(self.words[token >> 5]) >> (token & 31)) & 1)

    def lowest(self, skip: "Bits | None" = None) -> int | None:
        """The lowest allowed id, one of `skip`'s only when every allowed token is."""
        words = self.words if skip is None else self.words & ~skip.words
        nz = np.flatnonzero(words)
        if not nz.size:
            return None if skip is None else self.lowest()
        w = int(words[nz[0]]) & 0xFFFFFFFF
        return int(nz[0]) * 32 + (w & -w).bit_length() - 1

    @classmethod
    def of(cls, n: int, ids) -> "Bits":
        bits = cls(n)
        ids = np.asarray(ids, dtype=np.int64)
        np.bitwise_or.at(bits.words.view(np.uint32), ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        return bits

    def array(self) -> np.ndarray:
        """One bool per token, by numpy's unpackbits: at 163,840 tokens about 16 us, where looking
        each byte's 8 bits up in a table (fancy indexing) took about 280 us (bench/agents.py)."""
        return np.unpackbits(self.words.view(np.uint8), count=self.n, bitorder="little").view(bool)


class EndInTime:
    def __init__(self, tokenizer: BPETokenizer, n_vocab: int) -> None:
        self._closers = _ids(tokenizer, CLOSERS)
        self._openers = _ids(tokenizer, OPENERS)
        self._eos = tokenizer.eos_id
        self._blank = Bits.of(n_vocab, tokenizer.blank_ids)
        self._scratch = Bits(n_vocab)
        self.closing = False  # steered to the end (sticky)
        self._skip = 0  # steps before the next look-ahead
        self._jump = 0  # the most one token has been seen to add to the way's length

    def policy(self, matcher, bits: Bits | None = None) -> int | None:
        """The closing policy's token in the matcher's state: what the grammar forces, else the
        first allowed of CLOSERS, else the lowest allowed id, not a blank where another is allowed
        (None: no token is allowed). `bits` is the state's mask when the caller has it; else it is
        computed only where the grammar forces no token (the answer does not depend on it there):
        the look-ahead's way takes 2-4x fewer masks. Its time is mostly its steps' own (consume,
        the copies), not the masks (bench/agents.py)."""
        forced = matcher.compute_ff_tokens()
        if forced:
            return forced[0]
        if bits is None:
            bits = self._scratch.fill(matcher)
        choice = next((t for t in self._closers if t in bits), None)
        return bits.lowest(skip=self._blank) if choice is None else choice

    def shortest(self, matcher, cap: int, first: int | None = None) -> int:
        """Tokens from here (after `first`, counted, when given) to the grammar's end by the
        closing policy; `cap` when more."""
        shadow = matcher.deep_copy()
        n = 0
        if first is not None:
            shadow.consume_token(first)
            n = 1
        while n < cap:
            if shadow.is_stopped() or shadow.is_error():
                return n
            choice = self.policy(shadow)
            if choice is None:
                return n
            n += 1
            if choice == self._eos and shadow.is_accepting():
                return n
            shadow.consume_token(choice)
        return cap

    def steer(self, matcher, bits: Bits, room: int) -> tuple[int | None, list[int]]:
        """The token the reply must take now (None: the weights choose) and the tokens it may not."""
        if room > MAX_LOOKAHEAD:
            return None, []
        if self.closing:
            return self.policy(matcher, bits), []
        if self._skip > 0:  # far enough from the end that no token can make it unreachable yet
            self._skip -= 1
            return None, []
        need = self.shortest(matcher, room + 1)
        self.closing = room <= need + SLACK
        if self.closing:
            return self.policy(matcher, bits), []
        self._jump = max(self._jump, need)  # an upper bound until openers are measured
        banned = []
        for t in self._openers:
            if t in bits:
                after = self.shortest(matcher, room + 1, first=t)
                self._jump = max(self._jump, after - need)
                if after + SLACK > room:
                    banned.append(t)
        # A token adds at most `_jump` to the way's length (the largest structure an opener starts),
        # and the room shrinks by one: the next look-ahead is due before the two can meet.
        self._skip = max(0, (room - need - SLACK) // (self._jump + 1) - 1)
        return None, banned
