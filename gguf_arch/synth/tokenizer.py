"""Tokenizer files of a synthetic checkpoint: `tiktoken.model` and `tokenizer_config.json`.

The ranks are the 256 single bytes followed by byte-pair merges learned from a short English
text by the project's one BPE trainer (`train_bpe`, which the tests' vocabularies use too), so
they form a real BPE vocabulary: every merged token, encoded with the lower ranks only,
splits into exactly two tokens (what a tiktoken reader relies on to recover merges). The
256-slot special-token block follows the ranks, with Kimi K3's offsets.
"""
from __future__ import annotations

import base64
import heapq
import json
import re
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable

from ..io.output_paths import create
from ..errors import ConfigError
from .config import SPECIAL_OFFSETS, SPECIAL_SLOTS

_TRAINING_TEXT = """\
The lighthouse keeper woke before dawn, as he had done every morning for thirty years. He climbed
the narrow stairs, counted the one hundred and twelve steps, and trimmed the wick of the great lamp.
Outside, the sea was grey and quiet; a few gulls were circling over the harbour, waiting for the
fishing boats to return with their nets full of silver herring and mackerel.

His daughter lived in the town below, where she kept a small bakery near the market square. Each
morning she baked bread, sweet rolls with honey and raisins, and a dark rye loaf that the sailors
liked to carry on long voyages. On Sundays she walked up the hill with a basket, and the two of them
ate breakfast together at the table by the window, watching the ships pass the rocks.

In the winter of 1987 a storm broke three windows of the tower and flooded the kitchen. The keeper
wrote in his logbook: "Wind from the north-east, force ten. Lamp burning. All ships accounted for."
Later the harbour master told him that a cargo ship had seen the light just in time to turn away
from the reef, and that forty-two men owed him their lives. He only nodded and said that the lamp
had done the work, not him.

Children from the school often visited the lighthouse to learn how the lens turned and why the light
flashed twice every ten seconds. The keeper showed them the brass gears, the clockwork weights and
the old charts of the coast. "Every lighthouse has its own signal," he explained, "so a captain at
night can tell exactly where he is." The children asked many questions: how far the beam could reach,
whether he was ever lonely, and what he did when the fog came in so thick that nobody could see.

When the new automatic lamp was installed, the engineers thanked him and offered him a small house
in the town. He accepted, but every evening he still walked to the end of the pier and looked at the
tower until the first flash swept across the water. Then he went home, made a cup of tea, and read
the weather report aloud, as if someone at sea might be listening.
"""

# Training only: a simple word / number / punctuation split (the converter and the runtime use
# the Kimi pre-tokenizer; any split yields a valid vocabulary).
_PIECES = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")


def _bpe_split(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's byte-pair encoding of `token` with `ranks`: merge the lowest-ranked pair first."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        scored = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
        scored = [(r, i) for r, i in scored if r is not None]
        if not scored:
            break
        _, i = min(scored)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


Pair = tuple[bytes, bytes]


class _Pairs:
    """Adjacent-pair counts over the pieces' current symbols, kept up to date merge by merge, with
    a heap of (-count, *tie(pair), pair) whose entries go stale when a count changes (a fresh one
    is pushed then)."""

    def __init__(self, pieces: Counter, tie: Callable[[Pair], tuple]):
        self.tie = tie
        self.words = [[bytes([b]) for b in piece] for piece in pieces]
        self.counts = list(pieces.values())
        self.count: Counter = Counter()
        self.where: dict[tuple[bytes, bytes], set[int]] = defaultdict(set)
        for w, syms in enumerate(self.words):
            for pair in zip(syms, syms[1:]):
                self.count[pair] += self.counts[w]
                self.where[pair].add(w)
        self.heap = [(-c, *tie(p), p) for p, c in self.count.items()]
        heapq.heapify(self.heap)

    def most_frequent(self) -> Pair | None:
        """Pop the most frequent pair (ties by `tie`, then the pair), None when no pair is left."""
        while self.heap:
            entry = heapq.heappop(self.heap)
            neg, pair = entry[0], entry[-1]
            if neg and self.count.get(pair, 0) == -neg:
                return pair
        return None

    def push(self, pairs: Iterable[Pair]) -> None:
        for p in pairs:
            if self.count[p] > 0:
                heapq.heappush(self.heap, (-self.count[p], *self.tie(p), p))

    def merge(self, pair: Pair) -> None:
        """Merge `pair` in every piece that has it."""
        for w in list(self.where[pair]):
            touched = self._recount(w, -1)
            self.words[w] = _merged(self.words[w], pair)
            touched |= self._recount(w, +1)
            self.push(touched)  # every changed count gets a fresh entry; the old ones go stale

    def _recount(self, w: int, sign: int) -> set[Pair]:
        syms = self.words[w]
        for p in zip(syms, syms[1:]):
            self.count[p] += sign * self.counts[w]
            (self.where[p].add if sign > 0 else self.where[p].discard)(w)
        return set(zip(syms, syms[1:]))


def _merged(syms: list[bytes], pair: Pair) -> list[bytes]:
    out, i = [], 0
    while i < len(syms):
        if i + 1 < len(syms) and (syms[i], syms[i + 1]) == pair:
            out.append(syms[i] + syms[i + 1])
            i += 2
        else:
            out.append(syms[i])
            i += 1
    return out


def train_bpe(pieces: Counter, n_merges: int, *, tiktoken_consistent: bool = False) -> list[bytes]:
    """Byte-level BPE ranks from pre-tokenized pieces (bytes -> count): the 256 bytes, then up to
    `n_merges` tokens, each the most frequent adjacent pair merged everywhere, as tiktoken
    vocabularies are learned.

    With `tiktoken_consistent`, a merge is kept only when tiktoken, encoding the new token with the
    ranks before it, splits it into exactly that pair (what merge recovery from tiktoken ranks
    relies on), and ties go to the smaller merged bytes; without it, the vocabulary also has the
    inconsistent merges real ones carry, and ties go to the smaller pair.
    """
    pairs = _Pairs(pieces, (lambda p: (p[0] + p[1], p[0])) if tiktoken_consistent else (lambda p: ()))
    ranks = {bytes([b]): b for b in range(256)}
    skipped: set[Pair] = set()  # pairs passed over since the last merge: candidates again after it
    while len(ranks) < 256 + n_merges:
        pair = pairs.most_frequent()
        if pair is None:
            break
        merged = pair[0] + pair[1]
        if tiktoken_consistent and (merged in ranks or _bpe_split(merged, ranks) != list(pair)):
            skipped.add(pair)
            continue
        ranks.setdefault(merged, len(ranks))  # another split of the same bytes may have made it already
        pairs.merge(pair)
        pairs.push(skipped)
        skipped.clear()
    return list(ranks)

@lru_cache(maxsize=4)
def bpe_ranks(n_merges: int) -> tuple[bytes, ...]:
    """256 single bytes, then `n_merges` merged tokens, in rank order."""
    pieces = Counter(p.encode() for p in _PIECES.findall(_TRAINING_TEXT))
    ranks = train_bpe(pieces, n_merges, tiktoken_consistent=True)
    if len(ranks) < 256 + n_merges:
        raise ConfigError(f"vocab size {n_merges + 256 + SPECIAL_SLOTS} needs {n_merges} BPE merges; "
                          f"the built-in training text yields only {len(ranks) - 256}")
    return tuple(ranks)


def special_tokens(first_id: int) -> dict[int, str]:
    """id -> content for the 256-slot block starting at `first_id`."""
    return {first_id + o: SPECIAL_OFFSETS.get(o, f"<|reserved_token_{first_id + o}|>") for o in range(SPECIAL_SLOTS)}


def _tokenizer_config(first_id: int, max_length: int) -> dict:
    specials = special_tokens(first_id)
    named = [SPECIAL_OFFSETS[o] for o in sorted(SPECIAL_OFFSETS)]
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    return {
        "added_tokens_decoder": {str(i): {"content": c, **flags} for i, c in specials.items()},
        # As in K2/K3: every named special except bos, eos, unk and pad.
        "additional_special_tokens": [t for t in named if t not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": max_length,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def ranks_for_vocab(vocab_size: int) -> tuple[bytes, ...]:
    """The BPE ranks of a vocabulary of vocab_size ids (ranks + the special block)."""
    n_merges = vocab_size - SPECIAL_SLOTS - 256
    if n_merges < 0:
        raise ConfigError(f"vocab size must be at least {256 + SPECIAL_SLOTS} (256 bytes + {SPECIAL_SLOTS} "
                          f"special slots), got {vocab_size}")
    return bpe_ranks(n_merges)


def write_tokenizer(out_dir: Path, ranks: tuple[bytes, ...], max_length: int) -> None:
    """Write tiktoken.model and tokenizer_config.json (specials right after the ranks) into out_dir."""
    lines = "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks))
    cfg = _tokenizer_config(len(ranks), max_length)
    for name, text in (("tiktoken.model", lines), ("tokenizer_config.json", json.dumps(cfg, indent=2, ensure_ascii=False))):
        with create(out_dir / name, replace=True, mode="w") as f:  # never through a link left in the directory
            f.write(text)
