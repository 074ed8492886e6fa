"""What the prefix cache counts (KVCacheManager's lookups, and the
connector's, which the scheduler counts alike); engine/stats.py reports it."""

from __future__ import annotations

from dataclasses import dataclass


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
