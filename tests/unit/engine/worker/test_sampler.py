"""Sampler: greedy, temperature, top-k/top-p, min-p, logit adjustments,
seeds and logprobs."""

from __future__ import annotations

import math
from typing import cast

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from engine.sampling_params import SamplingParams
from engine.worker.penalties import TokenHistory
from engine.worker.sampler import Sampler, SamplingTensors, apply_min_p

VOCAB = 64


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    history: TokenHistory | None = None,
) -> torch.Tensor:
    gens = generators if generators is not None else [None] * len(params)
    tensors = SamplingTensors.from_params(params, gens, "cpu", history)
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


# --- min-p and the logit adjustments ----------------------------------------------


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 0.9, 1.0])
def test_min_p_drops_what_transformers_drops(min_p: float):
    scaled = _logits(16, seed=20) / 0.7
    log_min_p = torch.full((16, 1), math.log(min_p))
    got = apply_min_p(scaled, log_min_p)
    no_ids = cast(torch.LongTensor, torch.zeros(16, 1, dtype=torch.long))  # min-p reads none
    want = MinPLogitsWarper(min_p)(no_ids, scaled.clone())
    assert torch.equal(got, want)
    assert got.isinf().any()  # it filters...
    assert int((~got.isinf()).sum(dim=-1).min()) >= 1  # ...but never a whole row


def test_min_p_applies_after_temperature_and_renormalises():
    draws = 40_000
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    logits = row.expand(draws, 6).contiguous()
    # At T=1, min_p=0.3 keeps logits >= 2 + ln 0.3 = 0.80: the first three.
    torch.manual_seed(5)
    sampled = _sample(logits, [SamplingParams(temperature=1.0, min_p=0.3)] * draws)
    counts = torch.bincount(sampled, minlength=6).float()
    assert counts[3:].sum() == 0
    assert _chi_square(counts[:3], row[:3].softmax(dim=-1)) < _CHI2_999[2], counts
    # At T=2 the distribution is flatter: all but the last survive.
    hot = _sample(logits, [SamplingParams(temperature=2.0, min_p=0.3)] * draws)
    assert set(hot.tolist()) == {0, 1, 2, 3, 4}


def test_greedy_rows_ignore_min_p_and_plain_rows_keep_the_whole_vocab():
    logits = torch.zeros(3001, 8)
    logits[:, 0] = 1.0
    params = [SamplingParams(temperature=0.0, min_p=1.0)] + [
        SamplingParams(min_p=0.9 if i % 2 else 0.0) for i in range(3000)
    ]
    tensors = SamplingTensors.from_params(params, [None] * 3001, "cpu")
    assert tensors.log_min_p is not None and tensors.log_min_p[0, 0] == -math.inf
    torch.manual_seed(0)
    sampled = Sampler()(logits, tensors).sampled
    assert sampled[0] == 0
    assert set(sampled[1::2].tolist()) == set(range(8))  # min_p 0
    assert set(sampled[2::2].tolist()) == {0}  # e^-1 < 0.9
    only_greedy = [SamplingParams(temperature=0.0, min_p=0.5), SamplingParams()]
    assert SamplingTensors.from_params(only_greedy, [None] * 2, "cpu").log_min_p is None


def test_a_plain_batch_builds_no_adjustment_and_needs_no_history():
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=3)]
    tensors = SamplingTensors.from_params(params, [None] * 3, "cpu")
    assert tensors.logit_bias is None and tensors.penalties is None
    assert tensors.log_min_p is None
    with pytest.raises(ValueError, match=r"^history: "):
        SamplingTensors.from_params(
            [*params, SamplingParams(repetition_penalty=1.1)], [None] * 4, "cpu"
        )
    # A logit bias needs no history.
    biased = SamplingTensors.from_params([SamplingParams(logit_bias={1: 1.0})], [None], "cpu")
    assert biased.logit_bias is not None and biased.penalties is None


def test_greedy_choice_on_repetition_penalized_logits_matches_transformers():
    rows = 32
    logits = _logits(rows, seed=21)
    # Each row's history holds its own top tokens, so the penalty changes
    # the choice of many rows.
    top3 = logits.topk(3).indices.tolist()
    prompts = [[t[0]] for t in top3]
    outputs = [[t[1], t[1]] for t in top3]
    history = TokenHistory.from_lists(prompts, outputs)
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0)] * rows
    got = _sample(logits, params, history=history)
    hf = RepetitionPenaltyLogitsProcessor(3.0)
    ids = torch.tensor([p + o for p, o in zip(prompts, outputs, strict=True)])
    assert torch.equal(got, hf(ids, logits.clone()).argmax(dim=-1))
    assert not torch.equal(got, logits.argmax(dim=-1))


def test_adjustments_run_in_vllm_order():
    """bias, then repetition, then frequency/presence: each order below would
    pick the other token."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.2], [-9.0, -9.0, -0.2, 1.0, -9.0]])
    history = TokenHistory.from_lists([[3], [1]], [[], [3]])
    params = [
        # (1 + 1) / 2 = 1.0 < 1.2 (the other order: 1 / 2 + 1 = 1.5).
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}, repetition_penalty=2.0),
        # 1 / 2 - 1 = -0.5 < -0.2 (the other order: (1 - 1) * 2 = 0).
        SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0),
    ]
    assert _sample(logits, params, history=history).tolist() == [4, 2]


def test_logit_bias_forces_a_token_yet_logprobs_stay_raw():
    logits = _logits(2, seed=22)
    forced = int(logits[0].argmin())
    params = [
        SamplingParams(temperature=0.0, logprobs=1, logit_bias={forced: 100.0}),
        SamplingParams(temperature=1.0, logprobs=1, logit_bias={forced: 100.0}),
    ]
    tensors = SamplingTensors.from_params(params, [None] * 2, "cpu")
    out = Sampler()(logits, tensors)
    assert out.sampled.tolist() == [forced, forced]
    assert out.logprobs is not None
    raw = logits.log_softmax(dim=-1)
    lists = out.logprobs.to_lists()
    assert lists.logprobs[0][0] == pytest.approx(float(raw[0, forced]), abs=1e-6)
    assert lists.sampled_token_ranks[0] == VOCAB  # the least likely, raw
    assert lists.logprob_token_ids[0][1] == int(logits[0].argmax())


def test_plain_rows_sample_the_same_beside_rows_with_every_extra():
    """Rows asking for none of the extras, seeded or greedy, give the same
    tokens whether or not companions use them; seeded rows with extras are
    reproducible too."""
    target = _logits(3, seed=23)
    plain = [
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.1, top_p=0.8, seed=2),
    ]
    extra = [
        SamplingParams(temperature=0.8, min_p=0.2, presence_penalty=1.0, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={2: 3.0}),
        SamplingParams(temperature=1.2, frequency_penalty=0.7, logit_bias={5: -4.0}, seed=4),
    ]

    def run(params: list[SamplingParams], seeds: list[int | None]) -> list[list[int]]:
        gens = [None if s is None else _seeded(s) for s in seeds]
        outputs: list[list[int]] = [[] for _ in params]
        for step in range(6):
            logits = torch.cat([target, _logits(len(params) - 3, seed=50 + step)])
            history = TokenHistory.from_lists([[1, 2, 3]] * len(params), outputs)
            for row, tok in enumerate(_sample(logits, params, gens, history).tolist()):
                outputs[row].append(tok)
        return outputs

    torch.manual_seed(0)
    alone = run(plain, [1, None, 2])
    torch.manual_seed(1)
    mixed = run(plain + extra, [1, None, 2, 3, None, 4])
    assert mixed[:3] == alone
    torch.manual_seed(2)
    assert run(plain + extra, [1, None, 2, 3, None, 4]) == mixed
