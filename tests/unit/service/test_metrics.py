"""ServiceMetrics turns the scheduler's per-step stats into Prometheus counters."""

from __future__ import annotations

from engine.stats import PrefixCacheStats, SchedulerStats
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
