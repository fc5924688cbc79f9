"""What one graph computes: a micro-batch of token runs, each run the next tokens of one sequence.

The projections, the MoE and everything else that works token by token run on all the tokens of
the micro-batch at once (one pass over each weight per step, whatever the number of sequences);
what depends on a sequence's past runs per run: its attention over its own cache rows (blocks/mla.py
and dsa.py) and its KDA recurrence (blocks/kda.py).

Token order: runs are laid out grouped by token count (`groups`), the groups in the order their
first run came, so that each group's tokens are contiguous. ggml's `ssm_conv` and
`gated_delta_net` take several sequences from their 4th dimension only when every sequence has
the same token count: a group is one call for all its runs (every decoding sequence has one token,
so a decode step of any number of sequences is one call per KDA layer), and a prefill run of
another length is its own group. llama.cpp's `split_equal` cuts the batch into equal micro-batches
instead; grouping keeps the caller's batch in one graph, so the MoE weights are read once a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SeqRun:
    """The next `n_tokens` tokens of sequence `seq`, which holds `n_past` before them; their
    columns in the micro-batch start at `offset`."""

    seq: int
    n_past: int
    n_tokens: int
    offset: int = 0

    @property
    def n_kv(self) -> int:
        """Cache rows the run's last token sees (its own included)."""
        return self.n_past + self.n_tokens


@dataclass(frozen=True)
class Span:
    """Tokens t0 .. t0+n-1 of a run: the unit a run's attention goes through in (blocks/mla.py), so
    that no [cache rows x tokens] tensor grows with the micro-batch. Every token of a span sees
    the run's cache rows 0..run.n_kv-1, masked causally."""

    run: SeqRun
    t0: int
    n: int

    @property
    def n_kv(self) -> int:
        return self.run.n_kv

    @classmethod
    def whole(cls, run: SeqRun) -> "Span":
        return cls(run, 0, run.n_tokens)


def spans(run: SeqRun, n: int) -> list[Span]:
    """The run in spans of at most n tokens."""
    return [Span(run, t0, min(n, run.n_tokens - t0)) for t0 in range(0, run.n_tokens, n)]


@dataclass(frozen=True)
class RunGroup:
    """Runs with the same token count, contiguous in the micro-batch from `offset`."""

    runs: tuple[SeqRun, ...]
    offset: int

    @property
    def n_tokens(self) -> int:  # per run
        return self.runs[0].n_tokens

    @property
    def seqs(self) -> list[int]:
        return [r.seq for r in self.runs]


class UBatch:
    """Runs of distinct sequences, laid out grouped by token count (module docstring)."""

    def __init__(self, runs: Sequence[tuple[int, int, int]]):
        """runs: (seq, n_past, n_tokens) in the caller's order; at most one per sequence."""
        if not runs:
            raise ValueError("a micro-batch needs at least one run")
        seqs = [s for s, _, _ in runs]
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a sequence appears twice in one micro-batch: {seqs}")
        by_count: dict[int, list[tuple[int, int, int]]] = {}
        for run in runs:
            by_count.setdefault(run[2], []).append(run)
        self.groups: list[RunGroup] = []
        offset = 0
        for members in by_count.values():
            start = offset
            placed = []
            for seq, n_past, n in members:
                placed.append(SeqRun(seq, n_past, n, offset))
                offset += n
            self.groups.append(RunGroup(tuple(placed), start))
        self.n_tokens = offset
        self._by_seq = {r.seq: r for g in self.groups for r in g.runs}
        self.order = [s for s, _, _ in runs]  # the caller's order

    @classmethod
    def single(cls, n_past: int, n_tokens: int, seq: int = 0) -> "UBatch":
        return cls([(seq, n_past, n_tokens)])

    @property
    def runs(self) -> list[SeqRun]:
        """Every run in micro-batch order."""
        return [r for g in self.groups for r in g.runs]

    def run_of(self, seq: int) -> SeqRun:
        return self._by_seq[seq]

    def layout(self, tokens_by_seq: dict[int, Sequence[int]]) -> np.ndarray:
        """The token ids in micro-batch order (I32)."""
        return np.concatenate([np.asarray(tokens_by_seq[r.seq], dtype=np.int32) for r in self.runs])

    def last_columns(self) -> list[int]:
        """The column of each run's last token, in micro-batch order."""
        return [r.offset + r.n_tokens - 1 for r in self.runs]
