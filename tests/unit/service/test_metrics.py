"""ServiceMetrics turns the scheduler's per-step stats into Prometheus counters."""

from __future__ import annotations

from engine.stats import KVConnectorStats, PrefixCacheStats, SchedulerStats, TransferFailure
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
