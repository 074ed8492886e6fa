"""Logit bias and penalties against references: transformers' repetition
penalty processor and the OpenAI formula for frequency / presence."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.sampling_params import SamplingParams
from engine.worker.penalties import LogitBiasTensors, PenaltyTensors, TokenHistory

VOCAB = 97


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    # Token 0 is left out so that padding (0) counting would show.
    return [int(t) for t in rng.integers(1, 30, n)]


def _apply(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    tensors = PenaltyTensors.build(params, TokenHistory.from_lists(prompts, outputs), "cpu")
    assert tensors is not None
    return tensors.apply(logits)


def _history(rows: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    prompts = [_tokens(rng, int(rng.integers(1, 12))) for _ in range(rows)]
    outputs = [_tokens(rng, int(rng.integers(0, 15))) for _ in range(rows)]
    return prompts, outputs


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    logits = _logits(6, seed=1)
    prompts, outputs = _history(6, seed=2)
    got = _apply(logits, [SamplingParams(repetition_penalty=penalty)] * 6, prompts, outputs)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(6):
        ids = torch.tensor([prompts[row] + outputs[row]])
        want = hf(ids, logits[row : row + 1].clone())[0]
        assert torch.equal(got[row], want), row
    assert got[:, 0].tolist() == logits[:, 0].tolist()  # padding counted nothing


def test_frequency_and_presence_follow_the_formula_on_output_only() -> None:
    logits = _logits(5, seed=3)
    prompts, outputs = _history(5, seed=4)
    pairs = [(0.5, 0.0), (0.0, 1.5), (-1.0, 2.0), (2.0, -2.0), (0.3, 0.3)]
    params = [SamplingParams(frequency_penalty=f, presence_penalty=p) for f, p in pairs]
    got = _apply(logits, params, prompts, outputs)
    want = logits.clone()
    for row, (freq, pres) in enumerate(pairs):
        for token, count in Counter(outputs[row]).items():
            want[row, token] -= freq * count + pres
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Prompt-only tokens are not touched by these two.
    for row in range(5):
        for token in set(prompts[row]) - set(outputs[row]):
            assert got[row, token] == logits[row, token]


def test_output_start_counts_an_earlier_legs_tokens_as_output() -> None:
    """P/D: the decode leg's prompt ends with the prefill leg's token."""
    logits = torch.zeros(1, VOCAB)
    history = TokenHistory(
        token_ids=np.array([[4, 5, 6, 9, 9]]),
        num_tokens=np.array([5]),
        output_start=np.array([2]),  # 6 came from the prefill pod
        rows=np.array([0]),
    )
    tensors = PenaltyTensors.build([SamplingParams(frequency_penalty=1.0)], history, "cpu")
    assert tensors is not None
    got = tensors.apply(logits)[0]
    assert got[6] == -1.0 and got[9] == -2.0
    assert got[4] == got[5] == 0.0


def test_all_penalties_together_in_vllm_order() -> None:
    logits = _logits(3, seed=5)
    prompts, outputs = _history(3, seed=6)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.6)
    got = _apply(logits, [params] * 3, prompts, outputs)
    hf = RepetitionPenaltyLogitsProcessor(1.5)
    for row in range(3):
        want = hf(torch.tensor([prompts[row] + outputs[row]]), logits[row : row + 1].clone())[0]
        for token, count in Counter(outputs[row]).items():
            want[token] -= 0.4 * count + 0.6
        torch.testing.assert_close(got[row], want, rtol=0, atol=1e-5)


def test_rows_without_penalties_are_bit_exact_and_input_is_not_modified() -> None:
    logits = _logits(6, seed=7)
    before = logits.clone()
    prompts, outputs = _history(6, seed=8)
    plain = SamplingParams()
    params = [
        plain,
        SamplingParams(repetition_penalty=1.2),
        plain,
        SamplingParams(presence_penalty=1.0),
        SamplingParams(logit_bias={3: 5.0}),  # no penalty: not a penalty row
        SamplingParams(frequency_penalty=0.5),
    ]
    tensors = PenaltyTensors.build(params, TokenHistory.from_lists(prompts, outputs), "cpu")
    assert tensors is not None and tensors.rows is not None
    assert tensors.rows.tolist() == [1, 3, 5]
    got = tensors.apply(logits)
    assert torch.equal(logits, before)
    for row in (0, 2, 4):
        assert torch.equal(got[row], logits[row])
    for row in (1, 3, 5):
        assert not torch.equal(got[row], logits[row])
        alone = _apply(logits[row : row + 1], [params[row]], [prompts[row]], [outputs[row]])
        assert torch.equal(got[row], alone[0])


def test_unused_kinds_build_nothing() -> None:
    prompts, outputs = _history(2, seed=9)
    history = TokenHistory.from_lists(prompts, outputs)
    assert PenaltyTensors.build([SamplingParams()] * 2, history, "cpu") is None
    only_presence = PenaltyTensors.build([SamplingParams(presence_penalty=1.0)] * 2, history, "cpu")
    assert only_presence is not None and only_presence.rows is None
    assert only_presence.repetition is None and only_presence.frequency_add is None
    assert only_presence.seen_ids is None  # prompts are not even read
    assert only_presence.output_ids is not None
    first_output = min(len(p) for p in prompts)
    longest = max(len(p) + len(o) for p, o in zip(prompts, outputs, strict=True))
    assert only_presence.output_ids.shape == (2, longest - first_output)


def test_counts_of_sorted_runs() -> None:
    """Each (row, token) gets one addend, on the last entry of its run."""
    history = TokenHistory.from_lists([[1], [2, 2]], [[5, 3, 5, 5, 9], [4]])
    tensors = PenaltyTensors.build([SamplingParams(frequency_penalty=1.0)] * 2, history, "cpu")
    assert tensors is not None
    assert tensors.output_ids is not None and tensors.frequency_add is not None
    assert tensors.output_ids.tolist() == [[3, 5, 5, 5, 9], [4, 0, 0, 0, 0]]
    assert tensors.frequency_add.tolist() == [[-1, 0, 0, -3, -1], [-1, 0, 0, 0, 0]]


def test_logit_bias_adds_to_its_rows_only() -> None:
    logits = _logits(4, seed=10)
    params = [
        SamplingParams(logit_bias={0: 100.0, 5: -3.5}),
        SamplingParams(),
        SamplingParams(logit_bias={VOCAB - 1: 2.0}),
        SamplingParams(presence_penalty=1.0),
    ]
    bias = LogitBiasTensors.build(params, "cpu")
    assert bias is not None
    got = bias.apply(logits)
    want = logits.clone()
    want[0, 0] += 100.0
    want[0, 5] -= 3.5
    want[2, VOCAB - 1] += 2.0
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)  # a new tensor; the input is kept
    assert LogitBiasTensors.build([SamplingParams()] * 3, "cpu") is None
