"""sampling.py: greedy, seeded determinism, and what each filter keeps."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_graph_spec.generation.sampling import Sampler, SamplingParams, min_p_filter, top_k_filter, top_p_filter

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], dtype=np.float32))


def _kept(filtered: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(filtered)).tolist())


def test_greedy_is_argmax_whatever_the_seed_and_filters():
    rng = np.random.default_rng(0)
    for seed in range(5):
        row = rng.normal(size=300).astype(np.float32)
        s = Sampler(SamplingParams(temp=0.0, top_k=3, top_p=0.1, min_p=0.9, seed=seed))
        assert s(row) == int(np.argmax(row))


def test_same_seed_same_tokens_other_seed_other_tokens():
    rows = np.random.default_rng(1).normal(size=(64, 50)).astype(np.float32)

    def run(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        return [s(r) for r in rows]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_keeps_the_k_largest():
    assert _kept(top_k_filter(LOGITS, 2)) == {1, 3}
    assert _kept(top_k_filter(LOGITS, 0)) == set(range(5))


def test_top_k_ties_resolve_to_lower_id():
    assert _kept(top_k_filter(np.zeros(6, dtype=np.float32), 2)) == {0, 1}


def test_top_p_keeps_the_token_that_crosses_p():
    # sorted probs 0.4, 0.3, 0.15, ...: 0.4 < 0.5 <= 0.7 keeps two; 0.7 < 0.8 <= 0.85 keeps three
    assert _kept(top_p_filter(LOGITS, 0.5)) == {1, 3}
    assert _kept(top_p_filter(LOGITS, 0.8)) == {1, 3, 4}
    assert _kept(top_p_filter(LOGITS, 0.01)) == {1}
    assert _kept(top_p_filter(LOGITS, 1.0)) == set(range(5))


def test_min_p_is_relative_to_the_best_token():
    # threshold 0.5 * 0.4 = 0.2 keeps 0.4 and 0.3; 0.2 * 0.4 = 0.08 also keeps 0.15 and 0.1
    assert _kept(min_p_filter(LOGITS, 0.5)) == {1, 3}
    assert _kept(min_p_filter(LOGITS, 0.2)) == {1, 2, 3, 4}
    assert _kept(min_p_filter(LOGITS, 0.0)) == set(range(5))


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(temp=1.0, top_k=2, top_p=1.0, min_p=0.0), {1, 3}),
    (SamplingParams(temp=1.0, top_k=0, top_p=0.8, min_p=0.0), {1, 3, 4}),
    (SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.5), {1, 3}),
])
def test_draws_stay_inside_each_filter(params, allowed):
    s = Sampler(SamplingParams(**{**params.__dict__, "seed": 3}))
    assert {s(LOGITS) for _ in range(400)} == allowed


def test_temperature_sharpens_and_flattens():
    def share_of_best(temp: float) -> float:
        s = Sampler(SamplingParams(temp=temp, top_k=0, top_p=1.0, min_p=0.0, seed=11))
        return np.mean([s(LOGITS) == 1 for _ in range(4000)])

    cold, neutral, hot = share_of_best(0.1), share_of_best(1.0), share_of_best(5.0)
    assert cold > 0.9  # (0.4 / 0.3) ** 10 = 18: the best token dominates
    assert abs(neutral - 0.4) < 0.03  # temp 1 samples the model's own distribution
    assert hot < 0.3


def test_presence_and_frequency_penalties_subtract_once_and_per_occurrence():
    from ggml_graph_spec.generation.sampling import presence_frequency_penalty

    logits = np.zeros(5, np.float32)
    out = presence_frequency_penalty(logits, [1, 3, 3, 3], presence=0.5, frequency=0.25)
    assert out.tolist() == [0.0, -0.75, 0.0, -1.25, 0.0]  # 0.5 + 0.25 x 1; 0.5 + 0.25 x 3
    assert presence_frequency_penalty(logits, [1], 0.0, 0.0) is logits  # off: untouched


def test_a_presence_penalty_moves_greedy_off_a_repeated_token():
    # Token 1 is the best; once it is in the window a presence penalty larger than the gap to the
    # runner-up (token 3) makes greedy take token 3, a smaller one does not.
    gap = float(LOGITS[1] - LOGITS[3])
    for presence, want in ((gap * 2, 3), (gap / 2, 1)):
        s = Sampler(SamplingParams(temp=0.0, presence_penalty=presence))
        s.accept([1])
        assert s(LOGITS) == want
