"""Prometheus metrics for one server, served over HTTP (`--metrics-port`).

Families (all prefixed `tandem_`):

    requests_running, requests_waiting        gauges, as of the last step
    kv_cache_usage_ratio                      gauge, 0 to 1
    prefix_cache_queries_total, prefix_cache_hits_total   counters, tokens
    preemptions_total                         counter
    prompt_tokens_total, generation_tokens_total          counters
    requests_finished_total{finish_reason}    counter
    time_to_first_token_seconds               histogram
    inter_token_latency_seconds               histogram (per token)
    e2e_request_latency_seconds               histogram
    engine_step_seconds                       histogram (one engine step)
    kv_connector_queries_total, kv_connector_hits_total   counters, prompt tokens
    kv_transfer_ignored_completions_total     counter
    kv_recomputed_tokens_total                counter: prompt tokens computed
                                              because their KV load failed
    kv_transfer_failures_total{kind}          counter: failed loads / saves
                                              (engine.stats.TransferFailure)
    kv_leases_lapsed_total                    counter: KV held for a peer,
                                              freed unread (producer side)
    kv_held_requests                          gauge: finished requests whose
                                              KV a peer is still to read
    metrics_errors_total{where}               counter: metrics updates that
                                              raised (outputs went out anyway)
    lora_adapters_loaded                      gauge: LoRA adapters requests
                                              may name (--enable-lora)
    spec_decode_num_drafts_total              counter: verifying steps of a
                                              request with drafts
    spec_decode_num_draft_tokens_total        counter: draft tokens proposed
    spec_decode_num_accepted_tokens_total     counter: draft tokens accepted
    spec_decode_num_accepted_tokens_per_pos_total{position}
                                              counter: acceptances at each
                                              draft position (0-based)

The spec_decode families are vLLM's (vllm:spec_decode_*) and appear only
when the server speculates (`--speculative-config`).

Beside them, under vLLM's own names and labels (`model_name`, the served
model name, and `engine="0"`), the gauges that the endpoint pickers of the
Gateway API inference extension, llm-d and KServe read (its model-server
protocol), from the time the engine is up (`describe_engine`):

    vllm:num_requests_running, vllm:num_requests_waiting
    vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc (the older name)
    vllm:lora_requests_info{max_lora, running_lora_adapters,
                            waiting_lora_adapters}   (with --enable-lora)

`vllm:lora_requests_info`'s value is the wall-clock time of its last
update, its labels the adapters (comma-separated names) of the running
and the waiting requests; a picker reads the newest sample. Unlike vLLM,
which keeps every label set it ever had, only the current one is exposed.

Each server owns its registry, so several servers (tests) in one process
do not collide. `ServiceMetrics` is the engine's `EngineObserver`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from engine import RequestOutput, SchedulerStats, TransferFailure
from engine.stats import SpecDecodingStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.running = Gauge("tandem_requests_running", "Requests in the running set", registry=r)
        self.waiting = Gauge("tandem_requests_waiting", "Requests waiting to run", registry=r)
        self.kv_usage = Gauge(
            "tandem_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", registry=r
        )
        self.prefix_queries = Counter(
            "tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "tandem_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.preemptions = Counter("tandem_preemptions", "Requests preempted", registry=r)
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "tandem_requests_finished",
            "Requests finished, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds",
            "Time between consecutive generated tokens",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "Arrival to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            "tandem_engine_step_seconds",
            "Duration of one engine step (schedule, forward, sample, update)",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.connector_queries = Counter(
            "tandem_kv_connector_queries",
            "Prompt tokens of requests that asked the KV connector",
            registry=r,
        )
        self.connector_hits = Counter(
            "tandem_kv_connector_hits",
            "Prompt tokens loaded through the KV connector instead of computed",
            registry=r,
        )
        self.ignored_completions = Counter(
            "tandem_kv_transfer_ignored_completions",
            "Late, duplicate or unknown KV transfer completions (logged and ignored)",
            registry=r,
        )
        self.recomputed_tokens = Counter(
            "tandem_kv_recomputed_tokens",
            "Prompt tokens computed because their KV load failed or their blocks were missing",
            registry=r,
        )
        self.transfer_failures = Counter(
            "tandem_kv_transfer_failures",
            "Failed KV loads (per request) and saves (per batch), by kind",
            ["kind"],
            registry=r,
        )
        self.leases_lapsed = Counter(
            "tandem_kv_leases_lapsed",
            "KV blocks held for a peer and freed unread (lease or transfer timeout over)",
            registry=r,
        )
        self.held_requests = Gauge(
            "tandem_kv_held_requests",
            "Finished requests whose KV blocks a peer is still to read",
            registry=r,
        )
        self.metrics_errors = Counter(
            "tandem_metrics_errors",
            "Metrics updates that raised (the outputs were delivered regardless)",
            ["where"],
            registry=r,
        )
        self.lora_adapters = Gauge(
            "tandem_lora_adapters_loaded",
            "LoRA adapters loaded (that requests may name)",
            registry=r,
        )
        self._spec = _SpecDecodingCounters(r)
        self.picker = _EndpointPickerGauges(r)
        # The scheduler's cumulative counts as last seen: counters take increments.
        self._last_preemptions = 0
        self._last_ignored = 0
        self._last_recomputed = 0
        self._last_lapsed = 0
        self._last_failures: dict[TransferFailure, int] = {}

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Starts the HTTP endpoint (a daemon thread) at http://host:port/metrics."""
        start_http_server(port, addr=host, registry=self.registry)

    def describe_engine(self, model_name: str, max_loras: int | None) -> None:
        """Starts the endpoint pickers' gauges (at zero) under `model_name`;
        `max_loras` None: LoRA is off, no vllm:lora_requests_info."""
        self.picker.describe(model_name, max_loras)

    # EngineObserver -------------------------------------------------------------

    def on_step(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.inc(stats.prefix_cache_stats.queries)
        self.prefix_hits.inc(stats.prefix_cache_stats.hits)
        # The scheduler's count is cumulative; the counter takes increments.
        self.preemptions.inc(max(0, stats.num_preemptions - self._last_preemptions))
        self._last_preemptions = stats.num_preemptions
        ignored = stats.num_ignored_kv_completions
        self.ignored_completions.inc(max(0, ignored - self._last_ignored))
        self._last_ignored = ignored
        connector = stats.connector_prefix_cache_stats
        if connector is not None:
            self.connector_queries.inc(connector.queries)
            self.connector_hits.inc(connector.hits)
        self.held_requests.set(stats.num_held_requests)
        self._on_degradations(stats)
        if stats.spec_decoding is not None:
            self._spec.update(stats.spec_decoding)
        self.picker.update(stats)

    def _on_degradations(self, stats: SchedulerStats) -> None:
        recomputed = stats.num_kv_recomputed_tokens
        self.recomputed_tokens.inc(max(0, recomputed - self._last_recomputed))
        self._last_recomputed = recomputed
        totals = stats.kv_connector_totals
        self.leases_lapsed.inc(max(0, totals.leases_lapsed - self._last_lapsed))
        self._last_lapsed = totals.leases_lapsed
        for kind, count in totals.failures.items():
            last = self._last_failures.get(kind, 0)
            if count > last:
                self.transfer_failures.labels(kind=kind.value).inc(count - last)
                self._last_failures[kind] = count

    def on_metrics_error(self, where: str) -> None:
        self.metrics_errors.labels(where=where).inc()

    def on_engine_step(self, seconds: float) -> None:
        self.step.observe(seconds)

    def on_first_token(self, seconds_since_arrival: float) -> None:
        self.ttft.observe(seconds_since_arrival)
        self.generation_tokens.inc()

    def on_tokens(self, num_tokens: int, seconds_since_previous: float) -> None:
        self.generation_tokens.inc(num_tokens)
        per_token = seconds_since_previous / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        self.e2e.observe(seconds_since_arrival)
        self.prompt_tokens.inc(output.num_prompt_tokens)
        self.finished.labels(finish_reason=str(output.finish_reason or "unknown")).inc()


class _SpecDecodingCounters:
    """vLLM's spec_decode counters, fed the scheduler's cumulative figures.

    Created unregistered: the families join the registry with the first
    figures, so a server that does not speculate exposes none of them.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry: CollectorRegistry | None = registry
        self.drafts = Counter(
            "tandem_spec_decode_num_drafts",
            "Verifying steps of a request that had draft tokens",
            registry=None,
        )
        self.draft_tokens = Counter(
            "tandem_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=None
        )
        self.accepted_tokens = Counter(
            "tandem_spec_decode_num_accepted_tokens",
            "Draft tokens the target model accepted",
            registry=None,
        )
        self.accepted_per_pos = Counter(
            "tandem_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0-based)",
            ["position"],
            registry=None,
        )
        self._last = SpecDecodingStats(0)

    def update(self, stats: SpecDecodingStats) -> None:
        if self._registry is not None:
            for counter in (
                self.drafts,
                self.draft_tokens,
                self.accepted_tokens,
                self.accepted_per_pos,
            ):
                self._registry.register(counter)
            self._registry = None
        last = self._last
        self.drafts.inc(max(0, stats.num_drafts - last.num_drafts))
        self.draft_tokens.inc(max(0, stats.num_draft_tokens - last.num_draft_tokens))
        self.accepted_tokens.inc(max(0, stats.num_accepted_tokens - last.num_accepted_tokens))
        previous = last.num_accepted_tokens_per_pos
        for pos, count in enumerate(stats.num_accepted_tokens_per_pos):
            seen = previous[pos] if pos < len(previous) else 0
            # Incremented even by 0: each position's series exists from the start.
            self.accepted_per_pos.labels(position=str(pos)).inc(max(0, count - seen))
        self._last = stats  # a snapshot: the scheduler reports a new one each step


class _EndpointPickerGauges:
    """vLLM's gauges that endpoint pickers read, by vLLM's names and labels.

    Labelled: they have no sample until `describe` names the model.
    """

    LABELS = ("model_name", "engine")
    LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.time) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, self.LABELS, registry=registry)

        self._registry = registry
        self._clock = clock
        self.running = gauge("vllm:num_requests_running", "Requests in the running set")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to run")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent")
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage, 1 means 100 percent (older name of vllm:kv_cache_usage_perc)",
        )
        # Joins the registry only with LoRA on, as in vLLM.
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests: adapters of running and waiting requests",
            self.LORA_LABELS,
            registry=None,
        )
        self._children: list[Gauge] = []  # running, waiting, kv_usage, gpu_cache_usage
        self._max_lora: str | None = None
        self._lora_labels: tuple[str, str, str] | None = None

    def describe(self, model_name: str, max_loras: int | None) -> None:
        if self._children:
            raise RuntimeError(f"describe: the model is named already ({model_name!r} now)")
        gauges = (self.running, self.waiting, self.kv_usage, self.gpu_cache_usage)
        self._children = [g.labels(model_name, "0") for g in gauges]  # one engine
        for child in self._children:
            child.set(0)
        if max_loras is not None:
            self._registry.register(self.lora_info)
            self._max_lora = str(max_loras)
            self._set_lora_info(self._max_lora, "", "")

    def update(self, stats: SchedulerStats) -> None:
        if not self._children:
            return  # before describe: no model name yet
        running, waiting, kv_usage, gpu_cache_usage = self._children
        running.set(stats.num_running_reqs)
        waiting.set(stats.num_waiting_reqs)
        kv_usage.set(stats.kv_cache_usage)
        gpu_cache_usage.set(stats.kv_cache_usage)
        if self._max_lora is not None:
            self._set_lora_info(
                self._max_lora,
                ",".join(stats.waiting_lora_adapters),
                ",".join(stats.running_lora_adapters),
            )

    def _set_lora_info(self, max_lora: str, waiting: str, running: str) -> None:
        labels = (max_lora, waiting, running)
        self.lora_info.labels(*labels).set(self._clock())
        if labels != self._lora_labels:
            # One series, the current (a picker takes the newest anyway),
            # the new one set first so that a scrape never finds none.
            if self._lora_labels is not None:
                self.lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
