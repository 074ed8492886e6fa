"""Sampler: greedy, temperature, top-k/top-p, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker.sampler import Sampler, SamplingTensors

VOCAB = 64


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
) -> torch.Tensor:
    gens = generators if generators is not None else [None] * len(params)
    tensors = SamplingTensors.from_params(params, gens, "cpu")
    return Sampler()(logits, tensors).sampled


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_all_greedy_is_argmax_and_builds_no_random_tensors():
    logits = _logits(8)
    params = [SamplingParams(temperature=0.0) for _ in range(8)]
    tensors = SamplingTensors.from_params(params, [None] * 8, "cpu")
    assert tensors.all_greedy and tensors.temperature is None
    assert not tensors.any_top_k and not tensors.any_top_p
    assert tensors.max_num_logprobs is None
    out = Sampler()(logits, tensors)
    assert out.logprobs is None
    assert out.sampled.dtype == torch.int64
    assert torch.equal(out.sampled, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [1e-30, 1e-6, 1e-3])
def test_temperature_near_zero_is_greedy(temperature: float):
    # A gap of >= 1 between the best two logits: at T=1e-3 the runner-up's
    # probability is below e^-1000, and tiny T must not overflow to NaN.
    logits = torch.zeros(4, VOCAB)
    best = torch.tensor([3, 17, 40, 63])
    logits[torch.arange(4), best] = 1.0
    torch.manual_seed(0)
    for _ in range(20):
        sampled = _sample(logits, [SamplingParams(temperature=temperature)] * 4)
        assert torch.equal(sampled, best)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = _logits(16, seed=1)
    greedy = logits.argmax(dim=-1)
    torch.manual_seed(0)
    for _ in range(20):
        assert torch.equal(_sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * 16), greedy)
        assert torch.equal(
            _sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 16), greedy
        )
        both = SamplingParams(temperature=2.0, top_k=5, top_p=1e-6)
        assert torch.equal(_sample(logits, [both] * 16), greedy)


def test_mixed_batch_greedy_rows_are_argmax():
    logits = _logits(6, seed=2)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=i) for i in range(6)]
    tensors = SamplingTensors.from_params(params, [None] * 6, "cpu")
    assert not tensors.all_greedy and not tensors.all_random
    torch.manual_seed(0)
    sampled = Sampler()(logits, tensors).sampled
    assert torch.equal(sampled[1::2], logits[1::2].argmax(dim=-1))


def _nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    probs = logits.softmax(dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept: set[int] = set()
    mass = 0.0
    for tok in order:
        kept.add(tok)
        mass += float(probs[tok])
        if mass >= top_p:
            break
    return kept


def test_samples_stay_inside_top_k_and_nucleus():
    draws = 4000
    row = _logits(1, seed=3)
    logits = row.expand(draws, VOCAB).contiguous()
    torch.manual_seed(0)
    top_k = set(row[0].topk(5).indices.tolist())
    got_k = set(_sample(logits, [SamplingParams(top_k=5)] * draws).tolist())
    assert got_k <= top_k
    assert len(got_k) > 1  # it does sample, not just take the argmax

    nucleus = _nucleus(row[0], 0.6)
    got_p = set(_sample(logits, [SamplingParams(top_p=0.6)] * draws).tolist())
    assert got_p <= nucleus and len(got_p) > 1

    both = set(_sample(logits, [SamplingParams(top_k=3, top_p=0.9)] * draws).tolist())
    assert both <= top_k and both <= set(row[0].topk(3).indices.tolist())


def test_rows_without_filters_are_unaffected_by_companions_filters():
    # Unfiltered rows batched with filtered ones still reach the whole vocab.
    draws = 3000
    logits = torch.zeros(draws, 8)
    params = [
        SamplingParams(top_k=1 if i % 2 else 0, top_p=0.5 if i % 3 == 0 else 1.0)
        for i in range(draws)
    ]
    torch.manual_seed(0)
    sampled = _sample(logits, params)
    free = [i for i in range(draws) if i % 2 == 0 and i % 3 != 0]
    assert set(sampled[free].tolist()) == set(range(8))


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentiles of chi-square: the test is deterministic (fixed seed),
# the bound only has to be honest about what "matches" means.
_CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def test_empirical_distribution_matches_softmax_over_temperature():
    draws = 40_000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -1.5])
    temperature = 0.8
    torch.manual_seed(1234)
    sampled = _sample(
        row.expand(draws, 6).contiguous(), [SamplingParams(temperature=temperature)] * draws
    )
    counts = torch.bincount(sampled, minlength=6).float()
    stat = _chi_square(counts, (row / temperature).softmax(dim=-1))
    assert stat < _CHI2_999[5], counts


def test_empirical_distribution_with_top_k_and_top_p_is_renormalised():
    draws = 40_000
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.8)
    probs = row.softmax(dim=-1)
    # Top-5 then nucleus 0.8 of the renormalised top-5.
    top5 = probs[:5] / probs[:5].sum()
    keep = int((top5.cumsum(0) - top5 < 0.8).sum())
    expected = top5[:keep] / top5[:keep].sum()
    torch.manual_seed(99)
    sampled = _sample(row.expand(draws, 6).contiguous(), [params] * draws)
    counts = torch.bincount(sampled, minlength=6).float()
    assert keep == 3  # the case exercises a cut that top-k alone would not make
    assert counts[keep:].sum() == 0
    assert _chi_square(counts[:keep], expected) < _CHI2_999[keep - 1], counts


def test_seeded_rows_reproducible_across_companions_and_order():
    seeded = SamplingParams(temperature=1.0, seed=7)
    seeded_k = SamplingParams(temperature=0.7, top_k=10, seed=8)
    target = _logits(2, seed=4)
    steps = 5

    def run(companions: int, filtered: bool, reverse: bool) -> list[list[int]]:
        gens = [_seeded(7), _seeded(8)]
        out = []
        for step in range(steps):
            other = _logits(companions, seed=100 + step)
            other_params = [
                SamplingParams(temperature=1.3, top_p=0.7 if filtered else 1.0)
                for _ in range(companions)
            ]
            logits = torch.cat([target, other])
            params = [seeded, seeded_k, *other_params]
            generators: list[torch.Generator | None] = [*gens, *[None] * companions]
            if reverse:
                logits, params, generators = logits.flip(0), params[::-1], generators[::-1]
            sampled = _sample(logits, params, generators).tolist()
            if reverse:
                sampled = sampled[::-1]
            out.append(sampled[:2])
        return out

    torch.manual_seed(0)
    alone = run(0, False, False)
    torch.manual_seed(1)
    assert run(5, True, False) == alone
    torch.manual_seed(2)
    assert run(3, False, True) == alone
    # Successive steps advance the generator: not the same token every time.
    assert len({tuple(s) for s in alone}) > 1


def test_logprobs_and_ranks_match_a_direct_computation():
    logits = _logits(5, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=0.5, logprobs=1),
        SamplingParams(temperature=0.0),
    ]
    tensors = SamplingTensors.from_params(params, [None] * 5, "cpu")
    assert tensors.max_num_logprobs == 3
    torch.manual_seed(0)
    out = Sampler()(logits, tensors)
    assert out.logprobs is not None
    expected_lp = torch.log_softmax(logits, dim=-1)  # raw logits, no temperature
    lists = out.logprobs.to_lists([3, 0, 0, 1, 0])
    assert lists.cu_num_generated_tokens is None
    for i, tok in enumerate(out.sampled.tolist()):
        n = [3, 0, 0, 1, 0][i]
        top = expected_lp[i].topk(n)
        assert lists.logprob_token_ids[i] == [tok, *top.indices.tolist()]
        assert lists.logprobs[i] == pytest.approx(
            [float(expected_lp[i, tok]), *top.values.tolist()], abs=1e-5
        )
        rank = int((expected_lp[i] > expected_lp[i, tok]).sum()) + 1
        assert lists.sampled_token_ranks[i] == rank
    assert lists.sampled_token_ranks[0] == 1  # greedy row
    full = out.logprobs.to_lists()
    assert all(len(r) == 4 for r in full.logprob_token_ids)


def test_rank_counts_strictly_greater_so_ties_share_the_best_rank():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    tensors = SamplingTensors.from_params(
        [SamplingParams(temperature=0.0, logprobs=2)], [None], "cpu"
    )
    out = Sampler()(logits, tensors)
    assert out.logprobs is not None
    assert out.logprobs.sampled_token_ranks.tolist() == [1]
    lists = out.logprobs.to_lists()
    assert sorted(lists.logprob_token_ids[0][1:]) == [1, 2]
    assert math.isclose(lists.logprobs[0][1], lists.logprobs[0][2])


def test_bad_inputs_name_the_value():
    params = [SamplingParams()]
    with pytest.raises(ValueError, match="generators"):
        SamplingTensors.from_params(params, [], "cpu")
    tensors = SamplingTensors.from_params(params, [None], "cpu")
    with pytest.raises(ValueError, match=r"\[2, 8\]"):
        Sampler()(torch.zeros(2, 8), tensors)
    out = Sampler()(
        torch.zeros(1, 8), SamplingTensors.from_params([SamplingParams(logprobs=2)], [None], "cpu")
    )
    assert out.logprobs is not None
    with pytest.raises(ValueError, match="outside"):
        out.logprobs.to_lists([3])


@pytest.mark.parametrize("companion_top_p", [1.0, 0.5])
def test_top_k_keeps_ties_with_the_kth_value_on_both_paths(companion_top_p: float):
    # A companion with top-p sends the batch down the sort path; without
    # one it takes the topk path. Both must keep the same tied set.
    draws = 2000
    row = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0, -1.0]])
    logits = torch.cat([row.expand(draws, 6), torch.zeros(1, 6)])
    params = [SamplingParams(top_k=2)] * draws + [SamplingParams(top_p=companion_top_p)]
    tensors = SamplingTensors.from_params(params, [None] * (draws + 1), "cpu")
    assert tensors.any_top_p == (companion_top_p < 1.0)
    torch.manual_seed(0)
    sampled = Sampler()(logits, tensors).sampled[:draws]
    assert set(sampled.tolist()) == {0, 1, 2, 3}
