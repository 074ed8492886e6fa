"""EngineStatus: what an engine reports about itself, summed from its steps.

One type for both front doors: ``LLM.totals`` and ``AsyncEngine.status()``
(the service's GetServerStatus, ``tandem status``). ``EngineStatus.record``
folds in each step's ``SchedulerStats``; ``StepTimes`` keeps the recent
step durations whose medians the status reports.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.stats import SchedulerStats, SpecDecodingStats, TransferFailure

# Steps the medians look back over.
RECENT_STEPS = 128


@dataclass
class EngineStatus:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    uptime_seconds: float = 0.0
    draining: bool = False
    recent_step_ms_p50: float = 0.0
    recent_token_step_ms_p50: float = 0.0
    kv_connector_queries: int = 0
    kv_connector_hits: int = 0
    # Degradations, cumulative since start (see engine.stats).
    kv_recomputed_tokens: int = 0
    kv_leases_lapsed: int = 0
    kv_transfer_failures: dict[TransferFailure, int] = field(default_factory=dict)
    # Finished requests whose KV blocks a connector still holds (a prefill
    # pod's blocks waiting for the decode pod's READ): a drain waits for them.
    kv_held_requests: int = 0
    # Observer (metrics) calls that raised; outputs were delivered anyway.
    metrics_errors: int = 0
    # Speculative decoding since start (drafts, accepted tokens, per
    # position); None while the engine does not speculate.
    spec_decoding: SpecDecodingStats | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def record(self, stats: SchedulerStats) -> None:
        """Folds in one step's scheduler stats: gauges replaced, per-step
        counts summed, the scheduler's cumulative counts copied."""
        self.num_running = stats.num_running_reqs
        self.num_waiting = stats.num_waiting_reqs
        self.kv_cache_usage = stats.kv_cache_usage
        self.num_preemptions = stats.num_preemptions
        self.prefix_cache_queries += stats.prefix_cache_stats.queries
        self.prefix_cache_hits += stats.prefix_cache_stats.hits
        connector = stats.connector_prefix_cache_stats
        if connector is not None:
            self.kv_connector_queries += connector.queries
            self.kv_connector_hits += connector.hits
        self.kv_held_requests = stats.num_held_requests
        self.kv_recomputed_tokens = stats.num_kv_recomputed_tokens
        totals = stats.kv_connector_totals
        self.kv_leases_lapsed = totals.leases_lapsed
        self.kv_transfer_failures = totals.failures  # a snapshot: never mutated
        self.spec_decoding = stats.spec_decoding  # a snapshot too (cumulative)


class StepTimes:
    """Durations of the recent steps, and the medians the status reports."""

    def __init__(self, maxlen: int = RECENT_STEPS) -> None:
        self._seconds: deque[float] = deque(maxlen=maxlen)
        # (step seconds, tokens it produced after a request's first): the
        # token-weighted step time, what inter-token latency is compared with.
        self._token_steps: deque[tuple[float, int]] = deque(maxlen=maxlen)

    def add(self, seconds: float, later_tokens: int) -> None:
        """One step of ``seconds`` that gave ``later_tokens`` tokens to
        requests that already had one (a first token ends a TTFT, not an
        inter-token gap)."""
        self._seconds.append(seconds)
        if later_tokens > 0:
            self._token_steps.append((seconds, later_tokens))

    @property
    def num_inter_token_gaps(self) -> int:
        return sum(weight for _, weight in self._token_steps)

    def step_ms_p50(self) -> float:
        return statistics.median(self._seconds) * 1e3 if self._seconds else 0.0

    def token_step_ms_p50(self) -> float:
        return weighted_median(self._token_steps) * 1e3 if self._token_steps else 0.0


def weighted_median(samples: Iterable[tuple[float, int]]) -> float:
    """The value below which half the total weight lies."""
    ordered = sorted(samples)
    half = sum(weight for _, weight in ordered) / 2
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return ordered[-1][0]
