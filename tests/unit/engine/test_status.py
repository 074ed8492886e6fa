"""EngineStatus folds in scheduler stats; StepTimes' medians."""

from __future__ import annotations

import pytest

from engine.kv_cache.stats import PrefixCacheStats
from engine.stats import (
    KVConnectorStats,
    SchedulerStats,
    SpecDecodingStats,
    TransferFailure,
)
from engine.status import EngineStatus, StepTimes, weighted_median


def test_weighted_median() -> None:
    assert weighted_median([(1.0, 1), (5.0, 1), (3.0, 1)]) == 3.0
    # One step serving 64 streams outweighs three tail steps serving one.
    assert weighted_median([(0.30, 64), (0.05, 1), (0.05, 1), (0.05, 1)]) == 0.30
    assert weighted_median([(2.0, 1), (1.0, 1)]) == 1.0


def test_record_replaces_gauges_sums_counts_and_copies_totals() -> None:
    status = EngineStatus()
    totals = KVConnectorStats({TransferFailure.MISSING: 2}, leases_lapsed=1)
    for running in (3, 1):
        status.record(
            SchedulerStats(
                num_running_reqs=running,
                num_waiting_reqs=5,
                kv_cache_usage=0.5,
                num_preemptions=7,  # cumulative in the scheduler
                prefix_cache_stats=PrefixCacheStats(queries=16, hits=8),
                connector_prefix_cache_stats=PrefixCacheStats(queries=4, hits=2),
                num_held_requests=1,
                num_kv_recomputed_tokens=9,
                kv_connector_totals=totals,
            )
        )
    assert (status.num_running, status.num_waiting, status.kv_cache_usage) == (1, 5, 0.5)
    assert status.num_preemptions == 7
    assert (status.prefix_cache_queries, status.prefix_cache_hits) == (32, 16)
    assert status.prefix_cache_hit_rate == 0.5
    assert (status.kv_connector_queries, status.kv_connector_hits) == (8, 4)
    assert status.kv_held_requests == 1 and status.kv_recomputed_tokens == 9
    assert status.kv_leases_lapsed == 1
    assert status.kv_transfer_failures == {TransferFailure.MISSING: 2}
    assert EngineStatus().prefix_cache_hit_rate == 0.0


def test_record_keeps_the_latest_spec_decoding_totals() -> None:
    status = EngineStatus()
    status.record(SchedulerStats())
    assert status.spec_decoding is None  # not speculating
    first = SpecDecodingStats(2)
    first.observe_draft(2, 1)
    status.record(SchedulerStats(spec_decoding=first))
    second = first.copy()
    second.observe_draft(2, 2)
    status.record(SchedulerStats(spec_decoding=second))
    # Cumulative in the scheduler: the latest figures, not a sum of steps.
    spec = status.spec_decoding
    assert spec is not None
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (2, 4, 3)
    assert spec.num_accepted_tokens_per_pos == [2, 1]
    assert spec.acceptance_rate == 0.75 and spec.mean_acceptance_length == 2.5


def test_step_times_weigh_steps_by_their_later_tokens() -> None:
    times = StepTimes(maxlen=3)
    assert times.step_ms_p50() == 0.0 and times.token_step_ms_p50() == 0.0
    times.add(0.010, 0)  # first tokens only: no inter-token gap
    times.add(0.030, 64)
    times.add(0.020, 1)
    assert times.num_inter_token_gaps == 65
    assert times.step_ms_p50() == pytest.approx(20.0)
    assert times.token_step_ms_p50() == pytest.approx(30.0)
    times.add(0.040, 1)  # the oldest step leaves the window
    assert times.step_ms_p50() == pytest.approx(30.0)
