"""The runtime tokenizer, built from a GGUF's `tokenizer.ggml.*` metadata alone.

llama.cpp's byte-level BPE: text is cut at special tokens, each remaining span is split by the
`kimi-k2` pre-tokenizer, every piece is spelled in GPT-2's byte-to-unicode form and merged by the
rank of `tokenizer.ggml.merges`. Decoding maps tokens back to bytes; the streaming decoder holds
back an incomplete UTF-8 sequence until the token that completes it arrives.

For a BPE-trained vocabulary this gives tiktoken's ids. Merges cannot express everything tiktoken
does, though: tiktoken joins any two adjacent parts whose bytes form a token, so a token can arise
from a part ranked after it (with "ccacb" ranked before "cca", tiktoken makes "ccacb" from "cca" +
"cb"), while the converter, like llama.cpp's, records one merge per token from BPE over the lower
ranks only. Such tokens come out split here, as in llama.cpp.
"""
from __future__ import annotations

import codecs
import functools
from pathlib import Path
from typing import Sequence

import regex
from gguf import GGUFReader, Keys, TokenType

from gguf_arch.errors import GGUFError
from gguf_arch.io.gguf_file import open_gguf
from gguf_arch.arch.tokenizer import GGUF_TOKENIZER_MODEL, GGUF_TOKENIZER_PRE, KIMI_K2_PATTERN, byte_to_unicode

# V1 gives `regex` the set operations (`&&`) of the Rust regex engine tiktoken runs on.
_PRE_TOKENIZERS = {GGUF_TOKENIZER_PRE: regex.compile(KIMI_K2_PATTERN, flags=regex.V1)}
_TEXT_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED)  # spelled as plain UTF-8, found whole in text
_BYTE_FORM_TYPES = (TokenType.NORMAL, TokenType.UNKNOWN, TokenType.BYTE)
_PIECE_CACHE_SIZE = 1 << 16


@functools.cache
def _unicode_to_byte() -> dict[int, str]:
    """str.translate table from the byte-to-unicode form back to Latin-1 (one char per byte)."""
    return {ord(c): chr(b) for b, c in byte_to_unicode().items()}


@functools.cache
def _outside_byte_form() -> regex.Pattern:
    return regex.compile("[^" + "".join(map(regex.escape, byte_to_unicode().values())) + "]")


def _check_special_ids(reader: GGUFReader) -> None:
    """Every special token id the file names (BOS, EOS, EOT, padding, unknown, ...: gguf-py's
    `tokenizer.ggml.*_token_id` keys) is a token of its vocabulary."""
    n = len(reader.fields[Keys.Tokenizer.LIST].data) if Keys.Tokenizer.LIST in reader.fields else 0
    for key in reader.fields:
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            tid = _field(reader, key)
            if not isinstance(tid, int) or not 0 <= tid < n:
                raise GGUFError(f"{key} {tid!r} is outside the {n} tokens of {Keys.Tokenizer.LIST}")


class BPETokenizer:
    """Encode text to token ids and decode them back, as llama.cpp does for a `kimi-k2` vocabulary."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str], *,
                 pre: str = GGUF_TOKENIZER_PRE, bos_id: int | None = None, eos_id: int | None = None,
                 add_bos: bool = False) -> None:
        if len(token_types) != len(tokens):
            raise GGUFError(f"{Keys.Tokenizer.TOKEN_TYPE} has {len(token_types)} entries, "
                            f"{Keys.Tokenizer.LIST} has {len(tokens)}")
        if pre not in _PRE_TOKENIZERS:
            raise GGUFError(f"{Keys.Tokenizer.PRE} is {pre!r}, this runtime knows {sorted(_PRE_TOKENIZERS)}")
        for name, tid in (("bos", bos_id), ("eos", eos_id)):
            if tid is not None and not 0 <= tid < len(tokens):
                raise GGUFError(f"tokenizer.ggml.{name}_token_id {tid} is outside the {len(tokens)} tokens")
        if add_bos and bos_id is None:
            raise GGUFError(f"{Keys.Tokenizer.ADD_BOS} is true but the GGUF has no {Keys.Tokenizer.BOS_ID}")
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self._pre = _PRE_TOKENIZERS[pre]
        self._bytes = [_token_bytes(i, t, k) for i, (t, k) in enumerate(zip(tokens, token_types))]
        # Two separate lookups, so a special token never stands in for text spelled the same way.
        self._id_of = {t: i for i, (t, k) in enumerate(zip(tokens, token_types)) if k in _BYTE_FORM_TYPES}
        self._special_id = {t: i for i, (t, k) in enumerate(zip(tokens, token_types)) if k in _TEXT_TYPES}
        self._special_ids = frozenset(self._special_id.values())
        self._pair_rank = _pair_ranks(merges, self._id_of)
        self._no_merge = len(merges)  # above every merge rank
        longest_first = sorted(self._special_id, key=len, reverse=True)
        self._special = regex.compile("|".join(map(regex.escape, longest_first))) if longest_first else None
        self._encode_piece = functools.lru_cache(maxsize=_PIECE_CACHE_SIZE)(self._bpe)

    @classmethod
    def from_gguf(cls, source: Path | str | GGUFReader) -> "BPETokenizer":
        reader = source if isinstance(source, GGUFReader) else open_gguf(Path(source))
        model = _field(reader, Keys.Tokenizer.MODEL)
        if model != GGUF_TOKENIZER_MODEL:
            raise GGUFError(f"{Keys.Tokenizer.MODEL} is {model!r}, expected {GGUF_TOKENIZER_MODEL!r} (byte-level BPE)")
        add_bos = _field(reader, Keys.Tokenizer.ADD_BOS, required=False)
        _check_special_ids(reader)
        return cls(_field(reader, Keys.Tokenizer.LIST), _field(reader, Keys.Tokenizer.TOKEN_TYPE),
                   _field(reader, Keys.Tokenizer.MERGES), pre=_field(reader, Keys.Tokenizer.PRE),
                   bos_id=_field(reader, Keys.Tokenizer.BOS_ID, required=False),
                   eos_id=_field(reader, Keys.Tokenizer.EOS_ID, required=False), add_bos=bool(add_bos))

    @property
    def special_pattern(self) -> regex.Pattern | None:
        """What spells a special token in text (the longest spelling first), None without any."""
        return self._special

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    def encode(self, text: str, *, add_bos: bool | None = None, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text count as such when allowed.
        `add_bos` None follows the GGUF's `add_bos_token`."""
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id is None:
            raise GGUFError(f"cannot add a BOS token: the GGUF has no {Keys.Tokenizer.BOS_ID}")
        ids = [self.bos_id] if want_bos else []
        pos = 0
        for match in (self._special.finditer(text) if allow_special and self._special else ()):
            ids += self._encode_ordinary(text[pos:match.start()])
            ids.append(self._special_id[match.group()])
            pos = match.end()
        ids += self._encode_ordinary(text[pos:])
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a control token's text; nothing for an unused slot)."""
        if not 0 <= token_id < len(self._bytes):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self._bytes)}")
        return self._bytes[token_id]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def special_id(self, text: str) -> int | None:
        """The id of the special (control or user-defined) token spelled `text`, if there is one."""
        return self._special_id.get(text)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @functools.cached_property
    def blank_ids(self) -> tuple[int, ...]:
        """The ordinary tokens that are whitespace only (computed once: ~15 ms at 163,840 tokens)."""
        return tuple(i for i, b in enumerate(self._bytes) if b.isspace() and i not in self._special_ids)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._pre.findall(text):
            ids += self._encode_piece(piece)
        return ids

    def _bpe(self, piece: str) -> tuple[int, ...]:
        spelled = piece.encode("utf-8").decode("latin-1").translate(byte_to_unicode())
        # A piece that is a token is that token, as in tiktoken, even when its bytes would not BPE
        # into it (a token without a merge). llama.cpp does this only for vocabularies with
        # ignore_merges, which kimi-k2 is not; for BPE-trained vocabularies the result is the same.
        whole = self._id_of.get(spelled)
        if whole is not None:
            return (whole,)
        # Merge the adjacent pair of lowest merge rank, leftmost on ties, until none is left.
        symbols = list(spelled)
        never = self._no_merge
        ranks = [self._pair_rank.get(p, never) for p in zip(symbols, symbols[1:])]
        while ranks:
            best = min(ranks)
            if best == never:
                break
            i = ranks.index(best)
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            del ranks[i]
            if i > 0:
                ranks[i - 1] = self._pair_rank.get((symbols[i - 1], symbols[i]), never)
            if i < len(ranks):
                ranks[i] = self._pair_rank.get((symbols[i], symbols[i + 1]), never)
        # Every symbol is a token: _pair_ranks checked the single bytes and every merge result.
        return tuple(self._id_of[s] for s in symbols)


class StreamDecoder:
    """Turns token ids, one at a time, into text as soon as each character is complete."""

    def __init__(self, tokenizer: BPETokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text completed by this token (empty while a character is still partial)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held back, an incomplete character becoming U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _pair_ranks(merges: Sequence[str], id_of: dict[str, int]) -> dict[tuple[str, str], int]:
    ranks: dict[tuple[str, str], int] = {}
    for i, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not (left and sep and right) or left + right not in id_of or left not in id_of or right not in id_of:
            raise GGUFError(f"{Keys.Tokenizer.MERGES}[{i}] = {merge!r}: expected 'left right', both parts and "
                            "their concatenation being tokens")
        ranks.setdefault((left, right), i)
    missing = [b for b, c in byte_to_unicode().items() if c not in id_of]
    if missing:
        raise GGUFError(f"{Keys.Tokenizer.LIST} lacks {len(missing)} single-byte token(s), "
                        f"e.g. byte 0x{missing[0]:02x}: byte-level BPE needs all 256")
    return ranks


def _token_bytes(token_id: int, text: str, kind: int) -> bytes:
    if kind == TokenType.UNUSED:
        return b""
    if kind in _TEXT_TYPES:
        return text.encode("utf-8")
    if kind not in _BYTE_FORM_TYPES:
        raise GGUFError(f"{Keys.Tokenizer.TOKEN_TYPE}[{token_id}] is {kind}, not a llama.cpp token type")
    if _outside_byte_form().search(text):
        raise GGUFError(f"{Keys.Tokenizer.LIST}[{token_id}] = {text!r} is not in GPT-2 byte-to-unicode form")
    return text.translate(_unicode_to_byte()).encode("latin-1")


def _field(reader: GGUFReader, key: str, required: bool = True):
    field = reader.get_field(key)
    if field is None:
        if required:
            raise GGUFError(f"GGUF has no {key} (needed to tokenize)")
        return None
    return field.contents()
