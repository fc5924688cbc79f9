"""Tokenizer files of a synthetic checkpoint: `tiktoken.model` and `tokenizer_config.json`.

The ranks are the 256 single bytes followed by byte-pair merges learned from a short English
text, so they form a real BPE vocabulary: every merged token, encoded with the lower ranks only,
splits into exactly two tokens (what a tiktoken reader relies on to recover merges). The
256-slot special-token block follows the ranks, with Kimi K3's offsets.
"""
from __future__ import annotations

import base64
import json
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

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


def _merge_word(word: tuple[bytes, ...], a: bytes, b: bytes) -> tuple[bytes, ...]:
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _next_pair(words: Counter, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The most frequent adjacent pair that makes a new, tiktoken-consistent token (ties: bytes order)."""
    pairs: Counter = Counter()
    for word, n in words.items():
        for a, b in zip(word, word[1:]):
            pairs[(a, b)] += n
    order = lambda kv: (-kv[1], kv[0][0] + kv[0][1], kv[0][0])  # noqa: E731
    while pairs:
        (a, b), _ = min(pairs.items(), key=order)
        if a + b not in ranks and _bpe_split(a + b, ranks) == [a, b]:
            return a, b
        del pairs[(a, b)]
    return None


@lru_cache(maxsize=4)
def bpe_ranks(n_merges: int) -> tuple[bytes, ...]:
    """256 single bytes, then `n_merges` merged tokens, in rank order."""
    ranks = {bytes([i]): i for i in range(256)}
    words = Counter(tuple(bytes([c]) for c in p.encode()) for p in _PIECES.findall(_TRAINING_TEXT))
    for _ in range(n_merges):
        pair = _next_pair(words, ranks)
        if pair is None:
            raise ConfigError(f"vocab size {n_merges + 256 + SPECIAL_SLOTS} needs {n_merges} BPE merges; "
                              f"the built-in training text yields only {len(ranks) - 256}")
        ranks[pair[0] + pair[1]] = len(ranks)
        words = Counter({_merge_word(w, *pair): n for w, n in words.items()})
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
    (out_dir / "tiktoken.model").write_text(lines, encoding="ascii")
    cfg = _tokenizer_config(len(ranks), max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
