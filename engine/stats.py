"""Counters the scheduler reports each step (no torch, no I/O)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.kv_cache.stats import PrefixCacheStats


class TransferFailure(enum.Enum):
    """Why a KV transfer failed; the value is the metrics label."""

    # Store connectors (Redis, shared memory).
    MISSING = "missing"  # a block the load expected is not in the store
    CORRUPT = "corrupt"  # a stored block failed its header or checksum
    STORE_ERROR = "store_error"  # the store did not answer (down, refused)
    SAVE_FAILED = "save_failed"  # the store did not take a save
    # NIXL (consumer side).
    PEER_UNREACHABLE = "peer_unreachable"  # the producer's handshake failed
    PEER_INCOMPATIBLE = "peer_incompatible"  # model, layout or version differ
    PEER_RESTARTED = "peer_restarted"  # the producer's incarnation is gone
    TRANSFER_ERROR = "transfer_error"  # the READ failed or could not be posted
    TIMED_OUT = "timed_out"  # the handshake or READ outlived the timeout
    HOLD_LOST = "hold_lost"  # the producer had freed the blocks before the READ was claimed


@dataclass
class KVConnectorStats:
    """Degradations one connector saw since its last report (a worker's
    ``take_stats``), or, summed, since start (the scheduler's totals).

    ``failures``: failed loads and saves by kind, one per request (load) or
    batch (save) and kind; ``leases_lapsed``: KV blocks a producer held for a
    consumer and freed unread, because the consumer's heartbeats stopped
    (the lease lapsed) or the transfer timeout passed.
    """

    failures: dict[TransferFailure, int] = field(default_factory=dict)
    leases_lapsed: int = 0

    def add_failure(self, kind: TransferFailure, count: int = 1) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + count

    def add(self, other: KVConnectorStats) -> None:
        for kind, count in other.failures.items():
            self.add_failure(kind, count)
        self.leases_lapsed += other.leases_lapsed

    def copy(self) -> KVConnectorStats:
        return KVConnectorStats(dict(self.failures), self.leases_lapsed)

    def is_empty(self) -> bool:
        return not (self.failures or self.leases_lapsed)


@dataclass
class SpecDecodingStats:
    """Speculative decoding since start: drafts verified (steps where a
    request had drafts), draft tokens, how many the target accepted, and
    per draft position how often it was accepted (position j is accepted
    only if every position before it was)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step: accepted drafts plus the one sampled."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )


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
    # Finished requests whose blocks a KV connector still holds (a producer's
    # blocks waiting for a consumer to read them, a load still writing).
    num_held_requests: int = 0
    # Cumulative since start: prompt tokens computed again because their KV
    # load failed or their blocks were missing (recompute policy).
    num_kv_recomputed_tokens: int = 0
    # Cumulative since start (a snapshot: never mutated once reported).
    kv_connector_totals: KVConnectorStats = field(default_factory=KVConnectorStats)
    # Cumulative since start; None without speculative decoding.
    spec_decoding: SpecDecodingStats | None = None
    # Requests per LoRA adapter name, in the running set and the waiting
    # queue (the seeds' names). Empty while LoRA is off.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
