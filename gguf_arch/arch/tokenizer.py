"""Kimi K3's tiktoken tokenizer as GGUF `tokenizer.ggml.*` metadata (docs/reference/gguf.md#tokenizer).

`tiktoken.model` (one `base64(token bytes) rank` per line) and `tokenizer_config.json` (the
special-token block) are read directly: the checkpoint's own tokenizer code is never imported or
run. The GGUF side is llama.cpp's byte-level BPE: tokens in GPT-2's byte-to-unicode form and
merges recovered from the ranks, with the `kimi-k2` pre-tokenizer.
"""
from __future__ import annotations

import base64
import binascii
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as T
from gguf import Keys, TokenType

from .chat_template import gguf_chat_template
from .config import K3Config
from ..errors import TokenizerError
from ..io.jsonfile import read_json, read_text

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GGUF_TOKENIZER_MODEL = "gpt2"
GGUF_TOKENIZER_PRE = "kimi-k2"

# Kimi's tiktoken pat_str: Han runs stand alone; the letter classes exclude Han through set
# intersection (`&&`), which Python's `regex` module only understands with the V1 flag.
KIMI_K2_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

_SPECIAL_NAMES = ("bos", "eos", "pad", "unk")


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, the form llama.cpp's BPE
    vocabularies store tokens in: printable Latin-1 bytes map to themselves, the rest to
    U+0100 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in kept}
    shifted = [b for b in range(256) if b not in table]
    for n, b in enumerate(shifted):
        table[b] = chr(256 + n)
    return dict(sorted(table.items()))


def bytes_to_token_text(token: bytes) -> str:
    """A token's bytes in GPT-2 byte-to-unicode form."""
    # latin-1 turns each byte into the code point of the same value; translate then maps it.
    return token.decode("latin-1").translate(byte_to_unicode())


@dataclass(frozen=True)
class SpecialTokens:
    """The special-token block of tokenizer_config.json."""

    by_id: dict[int, str]  # id -> token text
    named: dict[str, int]  # "bos"/"eos"/"pad"/"unk" -> id, for the names the file gives
    add_bos: bool
    add_eos: bool


def read_ranks(path: Path) -> list[bytes]:
    """tiktoken.model -> token bytes indexed by rank; ranks must be exactly 0..n-1."""
    text = read_text(path, TokenizerError, f"not found (the K3 tokenizer needs {TIKTOKEN_FILE})")
    by_rank: dict[int, bytes] = {}
    rank_of: dict[bytes, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        token, rank = _parse_rank_line(path, lineno, line)
        if rank in by_rank:
            raise TokenizerError(f"{path}: line {lineno}: rank {rank} appears twice")
        if token in rank_of:
            raise TokenizerError(f"{path}: line {lineno}: token {token!r} appears twice "
                                 f"(ranks {rank_of[token]} and {rank})")
        by_rank[rank] = token
        rank_of[token] = rank
    if not by_rank:
        raise TokenizerError(f"{path}: holds no ranks")
    gaps = sorted(set(range(len(by_rank))) - by_rank.keys())
    if gaps:
        raise TokenizerError(f"{path}: ranks must be contiguous from 0; {len(gaps)} missing, "
                             f"the first is {gaps[0]} (highest rank {max(by_rank)})")
    missing_bytes = [b for b in range(256) if bytes([b]) not in rank_of]
    if missing_bytes:
        raise TokenizerError(f"{path}: byte-level BPE needs all 256 single-byte tokens; "
                             f"{len(missing_bytes)} missing, e.g. byte 0x{missing_bytes[0]:02x}")
    return [by_rank[r] for r in range(len(by_rank))]


def _parse_rank_line(path: Path, lineno: int, line: str) -> tuple[bytes, int]:
    fields = line.split()
    if len(fields) != 2:
        raise TokenizerError(f"{path}: line {lineno}: expected 'base64-token rank', got {line[:60]!r}")
    try:
        token = base64.b64decode(fields[0], validate=True)
    except (binascii.Error, ValueError):
        raise TokenizerError(f"{path}: line {lineno}: {fields[0][:40]!r} is not valid base64") from None
    if not token:
        raise TokenizerError(f"{path}: line {lineno}: empty token")
    if not _is_decimal(fields[1]):
        raise TokenizerError(f"{path}: line {lineno}: rank must be a non-negative integer, got {fields[1][:40]!r}")
    return token, int(fields[1])


def _is_decimal(text: str) -> bool:
    # str.isdigit alone accepts "²" and other digits int() refuses; 18 digits (far above any rank
    # or id) keep int() below Python's 4300-digit conversion limit, which raises ValueError.
    return text.isascii() and text.isdigit() and len(text) <= 18


def read_special_tokens(path: Path, n_ranks: int, vocab_size: int) -> SpecialTokens:
    """tokenizer_config.json -> the special ids (each above the ranks, below vocab_size)."""
    raw = _load_json(path)
    block = raw.get("added_tokens_decoder")
    if not isinstance(block, dict) or not block:
        raise TokenizerError(f"{path}: added_tokens_decoder must be a non-empty object of id -> token")
    by_id: dict[int, str] = {}
    for key, entry in block.items():
        if not _is_decimal(key):
            raise TokenizerError(f"{path}: added_tokens_decoder key {key!r} is not a token id")
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not content or not _is_utf8(content):
            raise TokenizerError(f"{path}: added_tokens_decoder[{key}] needs a non-empty 'content' string "
                                 f"of valid Unicode, got {content!r}")
        tid = int(key)
        if not n_ranks <= tid < vocab_size:
            raise TokenizerError(f"{path}: special token {content!r} has id {tid}, expected an id in "
                                 f"{n_ranks}..{vocab_size - 1} (above the {n_ranks} ranks, below vocab_size)")
        by_id[tid] = content
    dup = _first_duplicate(by_id)
    if dup:
        raise TokenizerError(f"{path}: special token {dup!r} is listed under more than one id")
    id_of = {content: tid for tid, content in by_id.items()}
    named = {}
    for name in _SPECIAL_NAMES:
        content = _special_name(path, raw, name)
        if content is None:
            continue
        if content not in id_of:
            raise TokenizerError(f"{path}: {name}_token {content!r} is not in added_tokens_decoder")
        named[name] = id_of[content]
    return SpecialTokens(by_id, named, _flag(path, raw, "add_bos_token"), _flag(path, raw, "add_eos_token"))


def _load_json(path: Path) -> dict:
    raw = read_json(path, TokenizerError, f"not found (the K3 tokenizer needs {TOKENIZER_CONFIG_FILE})",
                    invalid="not valid JSON")
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path}: expected a JSON object at the top level")
    return raw


def _is_utf8(text: str) -> bool:
    # JSON can carry lone surrogates ("\ud800"), which no GGUF string can hold.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_duplicate(by_id: dict[int, str]) -> str | None:
    seen: set[str] = set()
    for content in by_id.values():
        if content in seen:
            return content
        seen.add(content)
    return None


def _special_name(path: Path, raw: dict, name: str) -> str | None:
    # Hugging Face writes these either as the plain text or as a serialized AddedToken.
    value = raw.get(f"{name}_token")
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise TokenizerError(f"{path}: {name}_token must be a string, got {value!r}")


def _flag(path: Path, raw: dict, key: str) -> bool:
    # Absent means False: llama.cpp's kimi-k2 vocabulary adds no BOS unless the GGUF asks for it.
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise TokenizerError(f"{path}: {key} must be true or false, got {value!r}")
    return value


def recover_merges(ranks: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The BPE merge behind each multi-byte token, in rank order.

    For the token of rank r, BPE is re-run over its own bytes with only the ranks below r; when
    that ends in exactly two parts, they are its merge. A token that does not (possible in a
    vocabulary not made by BPE training) gets no merge, as in llama.cpp's converter.
    """
    rank_of = {token: r for r, token in enumerate(ranks)}
    merges = []
    for r, token in enumerate(ranks):
        if len(token) < 2:
            continue
        cut = _last_split(rank_of, token, r)
        if cut is not None:
            merges.append((token[:cut], token[cut:]))
    return merges


def _last_split(rank_of: dict[bytes, int], token: bytes, max_rank: int) -> int | None:
    """Where BPE over `token` with ranks < max_rank leaves its two parts, or None."""
    if len(token) == 2:
        return 1
    never = max_rank  # a pair ranked at or above max_rank can never merge here
    bounds = list(range(len(token) + 1))
    pair_ranks = [rank_of.get(token[i:i + 2], never) for i in range(len(token) - 1)]
    while len(bounds) > 3:
        best = min(pair_ranks)
        if best >= never:
            return None
        i = pair_ranks.index(best)  # leftmost on ties, as tiktoken
        del bounds[i + 1]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = rank_of.get(token[bounds[i - 1]:bounds[i + 1]], never)
        if i < len(pair_ranks):
            pair_ranks[i] = rank_of.get(token[bounds[i]:bounds[i + 2]], never)
    return bounds[1]


def token_table(ranks: list[bytes], specials: SpecialTokens, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token texts and types for ids 0..vocab_size-1 (>= len(ranks)): ranks NORMAL, specials
    CONTROL, ids with neither UNUSED."""
    texts = [bytes_to_token_text(t) for t in ranks]
    types = [int(TokenType.NORMAL)] * len(ranks)
    for tid in range(len(ranks), vocab_size):
        special = specials.by_id.get(tid)
        texts.append(special if special is not None else f"[PAD{tid}]")
        types.append(int(TokenType.CONTROL if special is not None else TokenType.UNUSED))
    return texts, types


def tokenizer_metadata(model_dir: Path, cfg: K3Config) -> list[tuple[str, Any, T, T | None]]:
    """(key, value, type, array element type) for every `tokenizer.ggml.*` key of the checkpoint."""
    model_dir = Path(model_dir)
    ranks = read_ranks(model_dir / TIKTOKEN_FILE)
    if len(ranks) > cfg.vocab_size:
        raise TokenizerError(f"{model_dir / TIKTOKEN_FILE}: {len(ranks)} ranks, more than config.json "
                             f"vocab_size {cfg.vocab_size}")
    specials = read_special_tokens(model_dir / TOKENIZER_CONFIG_FILE, len(ranks), cfg.vocab_size)
    texts, types = token_table(ranks, specials, cfg.vocab_size)
    eos = cfg.eos_token_id
    if not 0 <= eos < cfg.vocab_size or types[eos] == TokenType.UNUSED:
        raise TokenizerError(f"config.json: eos_token_id {eos} is not a token of the vocabulary "
                             f"(ids 0..{cfg.vocab_size - 1}, unused slots excluded)")
    merges = [f"{bytes_to_token_text(a)} {bytes_to_token_text(b)}" for a, b in recover_merges(ranks)]
    # K3 ends a turn with the config's eos (<|end_of_msg|>), not tokenizer_config's [EOS]
    # (docs/reference/gguf.md#tokenizer).
    ids = {**specials.named, "eos": eos}
    id_keys = {"bos": Keys.Tokenizer.BOS_ID, "eos": Keys.Tokenizer.EOS_ID,
               "pad": Keys.Tokenizer.PAD_ID, "unk": Keys.Tokenizer.UNK_ID}
    return [
        (Keys.Tokenizer.MODEL, GGUF_TOKENIZER_MODEL, T.STRING, None),
        (Keys.Tokenizer.PRE, GGUF_TOKENIZER_PRE, T.STRING, None),
        (Keys.Tokenizer.LIST, texts, T.ARRAY, T.STRING),
        (Keys.Tokenizer.TOKEN_TYPE, types, T.ARRAY, T.INT32),
        (Keys.Tokenizer.MERGES, merges, T.ARRAY, T.STRING),
        *[(id_keys[name], ids[name], T.UINT32, None) for name in _SPECIAL_NAMES if name in ids],
        (Keys.Tokenizer.ADD_BOS, specials.add_bos, T.BOOL, None),
        (Keys.Tokenizer.ADD_EOS, specials.add_eos, T.BOOL, None),
        (Keys.Tokenizer.CHAT_TEMPLATE, gguf_chat_template(model_dir, model_dir / TOKENIZER_CONFIG_FILE,
                                                          texts[ids["bos"]] if "bos" in ids else "", texts[eos]),
         T.STRING, None),
    ]
