"""Counters the scheduler reports each step (no torch, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last report, in tokens.

    Requests resumed after preemption are counted apart, as in vLLM, so the
    hit rate of fresh requests is not inflated by re-reads of their own KV.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler after one step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    # Cumulative since start.
    num_preemptions: int = 0
    # KV transfer completions for requests that were not waiting for them
    # (late, duplicate or unknown): logged, counted, otherwise ignored.
    num_ignored_kv_completions: int = 0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: PrefixCacheStats | None = None
