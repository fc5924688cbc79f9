"""A synthetic vocabulary of K3's real size for bench/grammar_libs.py, as the runtime's tokenizer.

No K3 tokenizer is available offline, so the tiny fixture's (656 ranks, 256 special tokens) is
extended with seeded random tokens to 163,584 ranks, and its special tokens are moved above them
to K3's own ids (163,584..163,839: `[BOS]` 163584, `<|end_of_msg|>` 163586, `<|open|>` 163587,
`<|close|>` 163588, `<|sep|>` 163589). The new ranks look like a BPE vocabulary's: words and
subwords of a synthetic lexicon with and without a leading space, capitalised, numbers,
punctuation runs, non-ASCII words, and some raw byte strings that are not UTF-8 (a few of them
starting with 0xFF, which llguidance reads as its special-token marker). 1 to 16 bytes each.

The tokenizer is the runtime's own `BPETokenizer`, built from the token table and merges the
converter would write (`token_table`, `recover_merges`), so both libraries are given exactly what
the server will give them. Texts for the walks are written with the same lexicon, so encoding them
uses the long tokens as a real vocabulary would.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from gguf_arch.arch.tokenizer import (SpecialTokens, bytes_to_token_text, read_ranks, read_special_tokens,
                                      recover_merges, token_table)
from ggml_graph_spec.text.tokenizer import BPETokenizer

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "k31pro-tiny"
K3_VOCAB = 163_840
K3_RANKS = 163_584  # the 256 ids above are special or reserved, as in K3's tokenizer_config.json
MAX_TOKEN_BYTES = 16
FF_TOKENS = 8  # normal tokens starting with 0xFF: enough to see whether a library mistakes them
ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
          "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "str", "th", "tr", "qu"]
VOWELS = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "io", "ou", "oo"]
CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "ng", "nd", "st", "ck", "x"]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
# Non-ASCII alphabets: Latin with accents, Greek, Cyrillic, Han (3 bytes a character), emoji (4).
SCRIPTS = ["àáâäæçèéêëìíîïñòóôöøùúûüß", "αβγδεζηθικλμνξοπρστυφχψω", "абвгдежзийклмнопрстуфхцчшщыэюя",
           "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没",
           "😀😂🙂🚀🔥✨👍🎉"]


@dataclass(frozen=True)
class Vocabulary:
    tokenizer: BPETokenizer
    lexicon: list[str]  # the words the ranks were drawn from, for writing texts that use them
    open_id: int
    close_id: int
    sep_id: int
    eos_id: int
    ff_tokens: list[int]  # normal tokens whose bytes start with 0xFF
    counts: dict[str, int]  # new ranks by kind


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.randint(1, 3)))


def make_lexicon(rng: random.Random, n: int) -> list[str]:
    words: set[str] = set()
    while len(words) < n:
        words.add(_word(rng))
    return sorted(words)


def _foreign(rng: random.Random) -> str:
    script = rng.choice(SCRIPTS)
    return (" " if rng.random() < 0.4 else "") + "".join(rng.choice(script) for _ in range(rng.randint(1, 4)))


def _raw_bytes(rng: random.Random) -> bytes:
    """A byte string that is not UTF-8: a multi-byte character cut short, or random high bytes."""
    if rng.random() < 0.5:
        char = rng.choice(rng.choice(SCRIPTS[2:])).encode()
        return char[:rng.randint(1, len(char) - 1)] if rng.random() < 0.5 else char[rng.randint(1, len(char) - 1):]
    return bytes(rng.randint(0x80, 0xFE) for _ in range(rng.randint(2, 6)))


def _draw(rng: random.Random, lexicon: list[str]) -> tuple[str, bytes]:
    """(kind, token bytes) of one new rank, with roughly a BPE vocabulary's mix of kinds."""
    r = rng.random()
    word = rng.choice(lexicon)
    if r < 0.40:
        return "word", (" " + word).encode()
    if r < 0.58:
        return "word", word.encode()
    if r < 0.68:
        return "word", ((" " if rng.random() < 0.6 else "") + word.capitalize()).encode()
    if r < 0.80:
        start = rng.randrange(len(word))
        return "subword", word[start:start + rng.randint(2, 6)].encode()
    if r < 0.84:
        return "number", str(rng.randint(0, 999)).encode()
    if r < 0.88:
        run = "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 3)))
        return "punctuation", ((" " if rng.random() < 0.3 else "") + run + ("\n" if rng.random() < 0.1 else "")).encode()
    if r < 0.95:
        return "non-ascii", _foreign(rng).encode()
    return "raw bytes", _raw_bytes(rng)


def synthetic_ranks(seed: int, n_ranks: int = K3_RANKS) -> tuple[list[bytes], list[str], dict[str, int]]:
    """The fixture's ranks extended to n_ranks with seeded random tokens; the lexicon; counts by kind."""
    rng = random.Random(seed)
    ranks = read_ranks(FIXTURE / "tiktoken.model")
    seen = set(ranks)
    lexicon = make_lexicon(rng, 60_000)
    counts = {"fixture": len(ranks)}
    extra = [b"\xff" + bytes(rng.randint(0x80, 0xFE) for _ in range(rng.randint(1, 3))) for _ in range(FF_TOKENS)]
    extra += [b"<|", b"|>", b"open", b"close", b"sep", b"think", b"tools", b"call", b"argument"]  # markers' pieces
    for token in extra:
        if token not in seen:
            seen.add(token)
            ranks.append(token)
    counts["markers' pieces and 0xFF"] = len(ranks) - counts["fixture"]
    while len(ranks) < n_ranks:
        kind, token = _draw(rng, lexicon)
        if 0 < len(token) <= MAX_TOKEN_BYTES and token not in seen:
            seen.add(token)
            ranks.append(token)
            counts[kind] = counts.get(kind, 0) + 1
    return ranks, lexicon, counts


def _specials_at_top(n_ranks: int) -> SpecialTokens:
    """The fixture's special tokens, same order and names, moved to start at n_ranks (K3's layout)."""
    fixture = read_special_tokens(FIXTURE / "tokenizer_config.json", 656, 912)
    shift = n_ranks - 656
    return replace(fixture, by_id={tid + shift: text for tid, text in fixture.by_id.items()},
                   named={name: tid + shift for name, tid in fixture.named.items()})


def build_vocabulary(seed: int, vocab_size: int = K3_VOCAB) -> Vocabulary:
    n_ranks = vocab_size - 256
    ranks, lexicon, counts = synthetic_ranks(seed, n_ranks)
    specials = _specials_at_top(n_ranks)
    texts, types = token_table(ranks, specials, vocab_size)
    merges = [f"{bytes_to_token_text(a)} {bytes_to_token_text(b)}" for a, b in recover_merges(ranks)]
    ids = {text: tid for tid, text in specials.by_id.items()}
    tokenizer = BPETokenizer(texts, types, merges, bos_id=specials.named.get("bos"), eos_id=ids["<|end_of_msg|>"])
    ff = [i for i, t in enumerate(ranks) if t[:1] == b"\xff" and len(t) > 1]
    return Vocabulary(tokenizer, lexicon, ids["<|open|>"], ids["<|close|>"], ids["<|sep|>"], ids["<|end_of_msg|>"],
                      ff, counts)
