"""Adaptive drafting: the cost model, the acceptance record, the choice of
drafts, and the wrapper's observe-plan-probe loop around a scripted
proposer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sampling_params import SamplingParams
from engine.spec_decode.adaptive import (
    CHEAP_PROBE_INTERVAL,
    MAX_DRAFTS,
    Acceptance,
    AdaptiveProposer,
    StepCost,
    plan_drafts,
)
from engine.spec_decode.proposer import ProposeInputs
from engine.worker.input_batch import CachedRequestState, InputBatch

# A CPU-like cost: 5 ms a step plus 2 ms a token row.
CPU = StepCost(np.array([1.0, 2.0, 8.0]), np.array([7e-3, 9e-3, 21e-3]))
# A GPU-like one: rows are nearly free.
GPU = StepCost(np.array([1.0, 64.0]), np.array([10e-3, 10.5e-3]))


def _gains(rate: float, n: int = 1) -> np.ndarray:
    return np.tile(np.cumprod(np.full(MAX_DRAFTS, rate)), (n, 1))


def test_step_cost_interpolates_and_extends_linearly() -> None:
    got = CPU(np.array([1.0, 1.5, 8.0, 10.0]))
    assert np.allclose(got, [7e-3, 8e-3, 21e-3, 25e-3])


def test_acceptance_counts_matches_and_a_mismatch_per_position() -> None:
    record = Acceptance(pending=[5, 6, 7, 8])
    record.observe([5, 6, 9])  # two drafts matched, the third missed
    prior = Acceptance()
    assert np.all(record.accepted[:2] > prior.accepted[:2])
    assert record.rejected[2] > prior.rejected[2] and record.accepted[2] < prior.accepted[2]
    # Never reached: unchanged.
    assert record.accepted[3] == prior.accepted[3] and record.rejected[3] == prior.rejected[3]
    assert not record.pending
    # Drafts all matched so far wait for the tokens of later steps.
    record = Acceptance(pending=[5, 6])
    record.observe([5])
    assert record.pending and record.accepted[0] == prior.accepted[0]
    record.observe([5, 6, 2])
    assert not record.pending and np.all(record.accepted[:2] > prior.accepted[:2])


def test_plan_sends_drafts_that_pay_and_none_that_do_not() -> None:
    available = np.array([5])
    assert plan_drafts(_gains(0.95), available, CPU)[0] == 5
    assert plan_drafts(_gains(0.2), available, CPU)[0] == 0
    # Cheap rows: even poor drafts pay.
    assert plan_drafts(_gains(0.3), available, GPU)[0] >= 1
    # Nothing available, nothing planned.
    assert plan_drafts(_gains(0.95), np.array([0]), CPU)[0] == 0


def test_plan_turns_drafts_off_at_a_large_batch() -> None:
    # 32 requests: a plain step is 32 rows; each draft row costs nearly a
    # token's share of the step, so only near-certain drafts pay.
    n = 32
    caps = plan_drafts(_gains(0.7, n), np.full(n, 5), CPU)
    assert caps.sum() == 0
    caps = plan_drafts(_gains(0.999, n), np.full(n, 5), CPU)
    assert caps.sum() > 0


def test_plan_prefers_the_likely_drafts_of_each_request() -> None:
    gains = np.vstack([_gains(0.95), _gains(0.1)])
    caps = plan_drafts(gains, np.array([5, 5]), CPU)
    assert caps[0] > 0 and caps[1] == 0


def _state(rid: str, tokens: list[int]) -> CachedRequestState:
    return CachedRequestState(
        req_id=rid,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        sampling_params=SamplingParams(max_tokens=100),
        generator=None,
        block_ids=([1],),
        num_computed_tokens=len(tokens),
    )


@dataclass
class Scripted:
    """A proposer that always proposes ``drafts`` (capped), and records
    what it was asked for."""

    drafts: list[int]
    asked: list[list[int]] = field(default_factory=list)

    def propose(self, inputs: ProposeInputs) -> list[list[int]]:
        caps = inputs.max_drafts.tolist()
        self.asked.append(caps)
        return [self.drafts[:cap] for cap in caps]

    def reset(self, req_id: str, num_valid: int) -> None:
        pass

    def remove(self, req_id: str) -> None:
        pass


def _step(proposer: AdaptiveProposer, batch: InputBatch, next_token: int) -> list[int]:
    """Propose for row 0, then append what the target "produced"."""
    rows = np.array([0], np.int64)
    drafts = proposer.propose(ProposeInputs(batch, rows, np.array([4], np.int64)))[0]
    batch.append_tokens(0, [next_token])
    return drafts


def test_wrapper_turns_wrong_drafts_off_and_probes_again() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=256, max_blocks_per_req=4)
    batch.add(_state("a", [1, 2, 3]))
    inner = Scripted([7, 7, 7, 7])
    proposer = AdaptiveProposer(inner, CPU, cheap=True)
    sent = [_step(proposer, batch, next_token=9) for _ in range(12)]
    assert sent[-1] == []  # every draft missed: they are off
    # Off, it is still probed now and then (asked for drafts, none sent).
    assert sum(1 for caps in inner.asked[-2 * CHEAP_PROBE_INTERVAL :] if caps[0]) >= 1
    # The text turns copy-heavy: the probes see it and drafts come back.
    for _ in range(40):
        drafts = _step(proposer, batch, next_token=7)
    assert drafts == [7, 7, 7, 7]


def test_wrapper_limit_by_batch_size() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=256, max_blocks_per_req=4)
    batch.add(_state("a", [1, 2, 3]))
    proposer = AdaptiveProposer(Scripted([7, 7]), GPU, cheap=True, disable_by_batch_size=1)
    assert _step(proposer, batch, next_token=7) == []


def test_config_keys() -> None:
    import pytest

    from engine.config import ConfigError, SpeculativeConfig

    config = SpeculativeConfig.from_json('{"adaptive": false, "disable_by_batch_size": 8}')
    assert not config.adaptive and config.disable_by_batch_size == 8
    assert SpeculativeConfig().adaptive
    with pytest.raises(ConfigError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=0)
