"""Test vocabularies: a seeded multilingual corpus and BPE ranks learned from it, so merge
recovery and the runtime BPE are exercised on thousands of merges learned the way tiktoken
vocabularies are (most frequent adjacent pair inside pre-tokenizer pieces, merged everywhere)."""
from __future__ import annotations

import random
from collections import Counter

import regex

from gguf_arch.arch.tokenizer import KIMI_K2_PATTERN
from gguf_arch.synth.tokenizer import train_bpe

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


def kimi_bpe(text: str, n_merges: int) -> list[bytes]:
    """Byte-level BPE ranks learned from `text` split by the Kimi pre-tokenizer (the project's one
    trainer, `gguf_arch.synth.tokenizer.train_bpe`, with the inconsistent merges real vocabularies
    carry)."""
    return train_bpe(Counter(m.encode("utf-8") for m in _SPLIT.findall(text)), n_merges)
