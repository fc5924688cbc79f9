"""Test vocabularies: a small byte-level BPE trainer and a seeded multilingual corpus, so merge
recovery and the runtime BPE are exercised on thousands of merges learned the way tiktoken
vocabularies are (most frequent adjacent pair inside pre-tokenizer pieces, merged everywhere)."""
from __future__ import annotations

import heapq
import random
from collections import Counter, defaultdict

import regex

from gguf_arch.arch.tokenizer import KIMI_K2_PATTERN

_SPLIT = regex.compile(KIMI_K2_PATTERN, flags=regex.V1)

# Syllables per script; words are drawn Zipf-like so that frequent words merge to single tokens.
_SYLLABLES = {
    "latin": "the an ing er on re st ou ly ed al ti co pro ver sa mi na lo ke ju wa th qu".split(),
    "cyrillic": "при ве т мир ло ко на ст ра ни до жи ть ся".split(),
    "greek": "κα λη με ρα το υ ς ει ναι".split(),
    "han": list("中文字词语言的是了在人有我他这个们来到时大地为子"),
    "kana": list("あいうえおかきくけこさしすせそたちつてとなにのはまやらをん") + list("カキクケコサシスセソ"),
    "hangul": list("한국어텍스트가나다라마바사아자차카타파하"),
    "arabic": "مر حب ا بال عا لم سل ام كت اب".split(),
}
_PUNCT = [" ", " ", " ", " ", ", ", ". ", "\n", "  ", "'s ", "'ll ", " 42 ", " 2025 ", " (", ") ", "、", "。",
          " 😀 ", "\t", ": ", "{\"k\": ", "}", " 3.14 "]


def multilingual_corpus(n_words: int, seed: int = 0) -> str:
    """Seeded text mixing seven scripts, digits, punctuation, emoji and whitespace runs."""
    rng = random.Random(seed)
    lexicon = []
    for script, syl in _SYLLABLES.items():
        for _ in range(300):
            word = "".join(rng.choice(syl) for _ in range(rng.randint(1, 4)))
            lexicon.append(word.capitalize() if script != "han" and rng.random() < 0.2 else word)
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    rng.shuffle(lexicon)
    words = rng.choices(lexicon, weights, k=n_words)
    return "".join(w + rng.choice(_PUNCT) for w in words)


def train_bpe(text: str, n_merges: int) -> list[bytes]:
    """Byte-level BPE ranks: the 256 bytes, then one token per learned merge."""
    pieces = Counter(m.encode("utf-8") for m in _SPLIT.findall(text))
    words = [[bytes([b]) for b in piece] for piece in pieces]
    counts = list(pieces.values())
    pair_count: Counter = Counter()
    where: dict[tuple[bytes, bytes], set[int]] = defaultdict(set)
    for w, syms in enumerate(words):
        for pair in zip(syms, syms[1:]):
            pair_count[pair] += counts[w]
            where[pair].add(w)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    ranks = [bytes([b]) for b in range(256)]
    known = set(ranks)
    while len(ranks) < 256 + n_merges and heap:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg or neg == 0:
            continue  # stale heap entry
        merged = pair[0] + pair[1]
        if merged not in known:  # another split of the same bytes may have made it already
            known.add(merged)
            ranks.append(merged)
        for w in list(where[pair]):
            _merge_in_word(words, counts, w, pair, pair_count, where, heap)
    return ranks


def _merge_in_word(words, counts, w, pair, pair_count, where, heap) -> None:
    syms = words[w]
    touched = set()
    for p in zip(syms, syms[1:]):
        pair_count[p] -= counts[w]
        where[p].discard(w)
        touched.add(p)
    out, i = [], 0
    while i < len(syms):
        if i + 1 < len(syms) and (syms[i], syms[i + 1]) == pair:
            out.append(syms[i] + syms[i + 1])
            i += 2
        else:
            out.append(syms[i])
            i += 1
    words[w] = out
    for p in zip(out, out[1:]):
        pair_count[p] += counts[w]
        where[p].add(w)
        touched.add(p)
    for p in touched:  # every changed count gets a fresh entry; the old ones go stale
        if pair_count[p] > 0:
            heapq.heappush(heap, (-pair_count[p], p))
