"""Draft verification: greedy acceptance, and outputs distributed exactly as
the target's under temperature (a chi-square test over a small Markov-chain
"model", seeded so it cannot flake)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.spec_decode.rejection import DraftRows, verify

V = 4
# The "model": p(next | previous token), every row a distribution.
CHAIN = torch.tensor(
    [
        [0.50, 0.30, 0.15, 0.05],
        [0.10, 0.60, 0.20, 0.10],
        [0.25, 0.25, 0.25, 0.25],
        [0.70, 0.05, 0.05, 0.20],
    ]
)


def _logits_for(prev: list[int]) -> torch.Tensor:
    return CHAIN[torch.tensor(prev)].log()


def test_greedy_accepts_while_argmax_matches() -> None:
    # Argmax after 0 is 0, after 1 is 1, after 3 is 0.
    rows = DraftRows.build([[0, 0, 1], [1, 2], []])
    logits = _logits_for([0, 0, 0, 3, 1, 1, 2, 3])
    result = verify(logits, rows, None, None, {})
    # Row 0: drafts 0, 0 accepted, 1 rejected (argmax 0): corrected to 0.
    # Row 1: 1 accepted, 2 rejected (argmax after 1 is 1): corrected to 1.
    # Row 2: no drafts, the argmax after 3.
    assert result.tokens == [[0, 0, 0], [1, 1], [0]]
    assert result.num_accepted == [2, 1, 0]


def test_greedy_all_accepted_adds_the_bonus_token() -> None:
    rows = DraftRows.build([[1, 1]])
    result = verify(_logits_for([0, 1, 1]), rows, None, None, {})
    # argmax after 0 is 0, not 1: rejected at once.
    assert result.tokens == [[0]]
    rows = DraftRows.build([[0, 0]])
    result = verify(_logits_for([0, 0, 0]), rows, None, None, {})
    assert result.tokens == [[0, 0, 0]] and result.num_accepted == [2]


def _sample_sequences(n: int, length: int, drafts_of: list[int]) -> torch.Tensor:
    """``n`` independent sequences of ``length`` tokens after token 0, by
    speculative steps: each step every row drafts ``drafts_of`` (a fixed,
    often wrong guess, cut to what it still needs) and verifies them."""
    seqs: list[list[int]] = [[0] for _ in range(n)]
    while True:
        todo = [i for i, s in enumerate(seqs) if len(s) < length + 1]
        if not todo:
            break
        drafts = [drafts_of[: length - len(seqs[i])] for i in todo]
        prevs = []
        for i, d in zip(todo, drafts, strict=True):
            prevs += [seqs[i][-1], *d]
        probs = CHAIN[torch.tensor(prevs)]
        result = verify(probs.log(), DraftRows.build(drafts), None, probs, {})
        for i, tokens in zip(todo, result.tokens, strict=True):
            seqs[i].extend(tokens)
    return torch.tensor([s[1 : length + 1] for s in seqs])


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-square quantile at z standard deviations
    (3.09: p = 0.001)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("drafts_of", [[1, 2], [0, 0, 3]])
def test_speculative_samples_follow_the_target_distribution(drafts_of: list[int]) -> None:
    torch.manual_seed(1234)
    length, n = 3, 12000
    seqs = _sample_sequences(n, length, drafts_of)
    # Exact probability of every 3-token sequence after token 0.
    expected = torch.ones([V] * length)
    for a in range(V):
        for b in range(V):
            for c in range(V):
                expected[a, b, c] = CHAIN[0, a] * CHAIN[a, b] * CHAIN[b, c]
    codes = seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2]
    observed = torch.bincount(codes, minlength=V**length).float()
    want = expected.flatten() * n
    chi2 = float(((observed - want) ** 2 / want).sum())
    assert chi2 < _chi_square_critical(V**length - 1), chi2


def test_the_chi_square_harness_catches_a_wrong_rule() -> None:
    """The same statistic on samples from a biased rule (always accept the
    draft) is far past the critical value: the test above can fail."""
    torch.manual_seed(1234)
    n = 12000
    probs = CHAIN[0]
    first = torch.multinomial(probs, n, replacement=True)
    biased = torch.where(torch.rand(n) < 0.5, torch.ones_like(first), first)
    observed = torch.bincount(biased, minlength=V).float()
    want = probs * n
    chi2 = float(((observed - want) ** 2 / want).sum())
    assert chi2 > _chi_square_critical(V - 1)


def test_seeded_rows_reproduce_and_ignore_their_companions() -> None:
    def run(companions: int, seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        drafts = [[1, 2, 0]] + [[3] * (i % 3) for i in range(companions)]
        prevs: list[int] = []
        for d in drafts:
            prevs += [0, *d]
        probs = CHAIN[torch.tensor(prevs)]
        result = verify(probs.log(), DraftRows.build(drafts), None, probs, {0: gen})
        return result.tokens[0]

    outs = [run(0, 7) for _ in range(3)] + [run(5, 7), run(9, 7)]
    assert all(o == outs[0] for o in outs)
    assert len({tuple(run(0, s)) for s in range(20)}) > 1  # the seed matters


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(0)
    drafts = [[0, 0], [1, 1]]
    prevs = [0, 0, 0, 1, 1, 1]
    probs = CHAIN[torch.tensor(prevs)]
    greedy_rows = torch.tensor([True, False])
    result = verify(probs.log(), DraftRows.build(drafts), greedy_rows, probs, {})
    assert result.tokens[0] == [0, 0, 0]  # the greedy row: all drafts are argmaxes
    assert 1 <= len(result.tokens[1]) <= 3
    # Logprob positions: accepted drafts, then the token chosen after them.
    assert result.position_tokens[:3].tolist() == [0, 0, 0]
