"""ServiceMetrics turns the scheduler's per-step stats into Prometheus counters."""

from __future__ import annotations

from prometheus_client import generate_latest

from engine.kv_cache.stats import PrefixCacheStats
from engine.stats import (
    KVConnectorStats,
    SchedulerStats,
    SpecDecodingStats,
    TransferFailure,
)
from service.metrics import ServiceMetrics


def test_connector_hits_and_ignored_completions_are_counted() -> None:
    metrics = ServiceMetrics()
    metrics.on_step(
        SchedulerStats(
            connector_prefix_cache_stats=PrefixCacheStats(requests=1, queries=100, hits=64),
            num_ignored_kv_completions=2,
        )
    )
    # Per-step connector stats add up; the ignored count is cumulative.
    metrics.on_step(
        SchedulerStats(
            connector_prefix_cache_stats=PrefixCacheStats(requests=1, queries=50, hits=32),
            num_ignored_kv_completions=3,
        )
    )
    metrics.on_step(SchedulerStats(num_ignored_kv_completions=3))
    value = metrics.registry.get_sample_value
    assert value("tandem_kv_connector_queries_total") == 150
    assert value("tandem_kv_connector_hits_total") == 96
    assert value("tandem_kv_transfer_ignored_completions_total") == 3


def test_degradations_are_counted_from_the_cumulative_figures() -> None:
    metrics = ServiceMetrics()
    first = KVConnectorStats(leases_lapsed=1)
    first.add_failure(TransferFailure.PEER_UNREACHABLE)
    metrics.on_step(
        SchedulerStats(num_kv_recomputed_tokens=84, kv_connector_totals=first, num_held_requests=2)
    )
    second = KVConnectorStats(leases_lapsed=3)
    second.add_failure(TransferFailure.PEER_UNREACHABLE, 2)
    second.add_failure(TransferFailure.MISSING)
    metrics.on_step(SchedulerStats(num_kv_recomputed_tokens=100, kv_connector_totals=second))
    metrics.on_metrics_error("step")
    value = metrics.registry.get_sample_value
    assert value("tandem_kv_recomputed_tokens_total") == 100
    assert value("tandem_kv_leases_lapsed_total") == 3
    assert value("tandem_kv_transfer_failures_total", {"kind": "peer_unreachable"}) == 2
    assert value("tandem_kv_transfer_failures_total", {"kind": "missing"}) == 1
    assert value("tandem_kv_held_requests") == 0
    assert value("tandem_metrics_errors_total", {"where": "step"}) == 1


def test_spec_decoding_counters_take_the_increments_of_the_cumulative_figures() -> None:
    metrics = ServiceMetrics()
    value = metrics.registry.get_sample_value
    spec = SpecDecodingStats(3)
    spec.observe_draft(3, 2)
    spec.observe_draft(3, 0)
    metrics.on_step(SchedulerStats(spec_decoding=spec.copy()))
    assert value("tandem_spec_decode_num_drafts_total") == 2
    assert value("tandem_spec_decode_num_draft_tokens_total") == 6
    assert value("tandem_spec_decode_num_accepted_tokens_total") == 2
    # Every position has a series from the first figures, accepted or not.
    per_pos = "tandem_spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(per_pos, {"position": str(p)}) for p in range(3)] == [1, 1, 0]
    spec.observe_draft(3, 3)
    spec.observe_draft(2, 1)  # fewer drafts near the end of max_tokens
    metrics.on_step(SchedulerStats(spec_decoding=spec.copy()))
    # The same figures again (a step without drafts): no increment.
    metrics.on_step(SchedulerStats(spec_decoding=spec.copy()))
    assert value("tandem_spec_decode_num_drafts_total") == 4
    assert value("tandem_spec_decode_num_draft_tokens_total") == 11
    assert value("tandem_spec_decode_num_accepted_tokens_total") == 6
    assert [value(per_pos, {"position": str(p)}) for p in range(3)] == [3, 2, 1]


def test_no_spec_decoding_families_without_speculation() -> None:
    metrics = ServiceMetrics()
    metrics.on_step(SchedulerStats(num_preemptions=1))
    exposition = generate_latest(metrics.registry).decode()
    assert "tandem_preemptions_total 1.0" in exposition
    assert "spec_decode" not in exposition
    # The first figures bring the families in, at zero.
    metrics.on_step(SchedulerStats(spec_decoding=SpecDecodingStats(2)))
    exposition = generate_latest(metrics.registry).decode()
    assert "tandem_spec_decode_num_drafts_total 0.0" in exposition
    assert 'tandem_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 0.0' in exposition
