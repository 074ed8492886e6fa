"""ServiceMetrics turns the scheduler's per-step stats into Prometheus counters."""

from __future__ import annotations

import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

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


PICKER_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)


def _scrape(metrics: ServiceMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The exposition, parsed: (labels, value) of each sample, by family."""
    text = generate_latest(metrics.registry).decode()
    return {
        family.name: [(s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
    }


def test_the_endpoint_pickers_gauges_carry_vllms_names_and_labels() -> None:
    metrics = ServiceMetrics()
    metrics.on_step(SchedulerStats(num_running_reqs=9))  # before describe: no samples
    assert all(_scrape(metrics)[name] == [] for name in PICKER_GAUGES)
    metrics.describe_engine("smol", max_loras=None)
    labels = {"model_name": "smol", "engine": "0"}
    scraped = _scrape(metrics)
    assert [scraped[name] for name in PICKER_GAUGES] == [[(labels, 0.0)]] * 4
    metrics.on_step(SchedulerStats(num_running_reqs=3, num_waiting_reqs=5, kv_cache_usage=0.25))
    scraped = _scrape(metrics)
    assert [scraped[name] for name in PICKER_GAUGES] == [
        [(labels, 3.0)],
        [(labels, 5.0)],
        [(labels, 0.25)],
        [(labels, 0.25)],
    ]
    text = generate_latest(metrics.registry).decode()
    assert 'vllm:num_requests_waiting{engine="0",model_name="smol"} 5.0' in text.splitlines()
    assert "vllm:lora_requests_info" not in text  # LoRA off, as in vLLM


def test_lora_requests_info_names_the_adapters_under_a_timestamp() -> None:
    metrics = ServiceMetrics()
    before = time.time()
    metrics.describe_engine("smol", max_loras=2)
    [(labels, stamp)] = _scrape(metrics)["vllm:lora_requests_info"]
    assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert before <= stamp <= time.time()
    stats = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=2,
        running_lora_adapters={"sql": 2, "chat": 1},
        waiting_lora_adapters={"poet": 2},
    )
    metrics.on_step(stats)
    [(labels, newer)] = _scrape(metrics)["vllm:lora_requests_info"]  # the old series is gone
    assert labels == {
        "max_lora": "2",
        "running_lora_adapters": "sql,chat",
        "waiting_lora_adapters": "poet",
    }
    assert stamp <= newer <= time.time()
    line = (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",'
        'waiting_lora_adapters="poet"} '
    )
    assert any(x.startswith(line) for x in generate_latest(metrics.registry).decode().splitlines())
    metrics.on_step(SchedulerStats())  # idle: empty lists, a fresh stamp
    [(labels, last)] = _scrape(metrics)["vllm:lora_requests_info"]
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("", "")
    assert newer <= last
