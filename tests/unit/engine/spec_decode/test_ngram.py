"""The vectorised n-gram proposer against a plain per-request reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.spec_decode.ngram import NgramProposer


def reference(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix (max_n down to min_n) seen before; what followed
    its most recent earlier occurrence."""
    length = len(history)
    for n in range(max_n, min_n - 1, -1):
        if length <= n:
            continue
        suffix = history[length - n :]
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : min(start + n + k, length)]
    return []


def _propose(proposer: NgramProposer, histories: list[list[int]]) -> list[list[int]]:
    width = max(len(h) for h in histories) + 7  # rows wider than the history
    tokens = np.full((len(histories), width), -5, np.int64)
    for i, h in enumerate(histories):
        tokens[i, : len(h)] = h
    lengths = np.array([len(h) for h in histories], np.int64)
    return proposer.propose(tokens, lengths)


def test_hand_cases() -> None:
    p = NgramProposer(k=3, min_n=1, max_n=3)
    histories = [
        [1, 2, 3, 4, 5, 9, 1, 2, 3],  # "1 2 3" seen: propose 4 5 9
        [7, 8, 9, 10],  # nothing repeats: nothing
        [5, 6, 5, 7, 5],  # only "5" repeats; the most recent: 7
        [3, 1, 2, 1, 2],  # "1 2" at 1 proposes 1 2 (running into the suffix)
        [4],  # too short
        [1, 2, 3, 1, 2],  # longest is "1 2" (n=2): 3 1 2
    ]
    assert _propose(p, histories) == [[4, 5, 9], [], [7, 5], [1, 2], [], [3, 1, 2]]


def test_longer_ngrams_win_over_more_recent_short_ones() -> None:
    p = NgramProposer(k=2, min_n=1, max_n=2)
    # "8 9" occurred at the start (followed by 1); "9" alone recently (followed by 3).
    assert _propose(p, [[8, 9, 1, 0, 9, 3, 8, 9]]) == [[1, 0]]


@pytest.mark.parametrize(("k", "min_n", "max_n"), [(1, 1, 1), (3, 1, 4), (5, 2, 3), (8, 3, 5)])
def test_equals_the_reference_on_random_repetitive_histories(
    k: int, min_n: int, max_n: int
) -> None:
    rng = random.Random(k * 100 + min_n * 10 + max_n)
    proposer = NgramProposer(k, min_n, max_n)
    for _ in range(20):
        histories = []
        for _ in range(rng.randint(1, 12)):
            vocab = rng.randint(2, 12)  # small vocabularies repeat n-grams
            histories.append([rng.randrange(vocab) for _ in range(rng.randint(1, 60))])
        want = [reference(h, k, min_n, max_n) for h in histories]
        assert _propose(proposer, histories) == want


def test_bad_settings_name_the_knob() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(k=0)
    with pytest.raises(ValueError, match="prompt_lookup_min/max"):
        NgramProposer(k=2, min_n=3, max_n=2)


def test_an_empty_batch_proposes_nothing() -> None:
    p = NgramProposer(k=2)
    assert p.propose(np.zeros((0, 4), np.int64), np.zeros(0, np.int64)) == []
