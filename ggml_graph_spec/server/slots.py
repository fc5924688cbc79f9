"""Slots and the prompt cache: which slot a request runs in, and how much of its prompt is there.

A slot is one of the model's sequences. What it holds after a request (the prompt and the reply's
tokens, its "history") stays cached. A KDA layer folds the whole history into one state, so a
slot's cache can serve a new prompt only when its WHOLE history is a prefix of it: a history can
never be cut back to a shorter common prefix. Each slot also keeps checkpoints: the state at the
end of its last prompts (`--ctx-checkpoints`, as llama-server keeps for recurrent models), so
that the next turn of a chat reuses its previous prompt even when the reply, as the client sends
it back, tokenizes differently from the tokens the model sampled.

A request goes to the free slot that holds the longest cached prefix of its prompt (its history
or one of its checkpoints; at least one prompt token is always left to compute the first logits);
with none, to the free slot used least recently.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Checkpoint:
    tokens: tuple[int, ...]  # what the state holds
    data: bytes  # Model.state_get's bytes (engine/state.py)


@dataclass(eq=False)
class Slot:
    id: int
    keep: int  # checkpoints kept (--ctx-checkpoints)
    history: list[int] = field(default_factory=list)  # the tokens the sequence holds
    checkpoints: deque = field(default_factory=deque)
    last_used: int = 0  # a counter: higher is more recent
    busy: bool = False

    def remember(self, checkpoint: Checkpoint) -> None:
        """Keep a checkpoint, the oldest one going when there are more than `keep`."""
        if self.keep <= 0:
            return
        self.checkpoints = deque((c for c in self.checkpoints if c.tokens != checkpoint.tokens), maxlen=self.keep)
        self.checkpoints.append(checkpoint)

    def checkpoint_bytes(self) -> int:
        return sum(len(c.data) for c in self.checkpoints)


@dataclass(frozen=True)
class Choice:
    slot: Slot
    cached: int  # prompt tokens already in the slot once prepared
    checkpoint: Checkpoint | None  # restore this first (None: the history as it is, or nothing)


def prefix_length(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """len(cached) when it is a prefix of prompt that leaves at least one token to compute; else 0."""
    n = len(cached)
    return n if 0 < n < len(prompt) and list(prompt[:n]) == list(cached) else 0


def best_source(slot: Slot, prompt: Sequence[int]) -> tuple[int, Checkpoint | None]:
    """The longest cached prefix this slot offers: its history, or a checkpoint."""
    best, source = prefix_length(slot.history, prompt), None
    for c in slot.checkpoints:
        n = prefix_length(c.tokens, prompt)
        if n > best:
            best, source = n, c
    return best, source


def choose(slots: Sequence[Slot], prompt: Sequence[int], use_cache: bool) -> Choice | None:
    """The slot for a prompt (None: every slot is busy)."""
    free = [s for s in slots if not s.busy]
    if not free:
        return None
    if use_cache:
        scored = [(best_source(s, prompt), s) for s in free]
        (n, checkpoint), slot = max(scored, key=lambda x: (x[0][0], -x[1].last_used))
        if n:
            return Choice(slot, n, checkpoint)
    return Choice(min(free, key=lambda s: s.last_used), 0, None)
