"""KVTransfers: the scheduler's record of the KV a connector moves.

The scheduler decides who computes what. A KV connector loads KV from
outside (within a step, or asynchronously while the request waits in
WAITING_FOR_REMOTE_KVS) and may hold a finished request's blocks while it
sends them. This class keeps the scheduler's side of that, so the scheduler
reads as the catch-up algorithm:

* asynchronous loads that finished (their request may start, with what
  arrived cached and counted as computed) and loads that lost blocks;
* lost blocks (``invalid_block_ids``): the requests that used them are
  rewound to recompute, or ended under ``kv_load_failure_policy="fail"``;
* finished sends (``finished_sending``): the held blocks can go;
* parked blocks: waiting requests holding the blocks of finished loads,
  which give them back, one at a time, when nothing else could ever make
  room (the scheduler decides when: ``pending`` tells it whether a transfer
  still could);
* counts for SchedulerStats: connector hits, recomputed tokens, ignored
  completions, the connector's failure totals.

Every scheduler has one; without a connector it stays empty.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.stats import PrefixCacheStats
from engine.request import Request, RequestStatus
from engine.stats import KVConnectorStats, SchedulerStats

if TYPE_CHECKING:
    from engine.kv_cache.events import KVCacheEvent
    from engine.kv_cache.manager import KVCacheBlocks
    from engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
    from engine.kv_transfer.params import KVTransferParams
    from engine.outputs import KVConnectorOutput
    from engine.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

FAILURE_POLICIES = ("recompute", "fail")


class KVTransfers:
    """Called from the scheduler thread only."""

    def __init__(
        self,
        connector: KVConnectorBase | None,
        kv_cache_manager: KVCacheManager,
        requests: dict[str, Request],
        failure_policy: str = "recompute",
        log_stats: bool = True,
    ) -> None:
        """`requests`: the scheduler's table of live requests and of
        finished ones whose blocks a connector holds (read here, never
        changed). `failure_policy`: what a failed KV load does to its
        requests: "recompute" the lost tokens, or "fail" them (an error)."""
        if failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy={failure_policy!r} is invalid: "
                "expected 'recompute' or 'fail'"
            )
        if connector is not None and kv_cache_manager.num_groups != 1:
            # Connectors move whole blocks, every layer's KV: the engine
            # keeps one KV cache group when one is configured.
            raise ValueError(
                f"a KV connector needs one KV cache group, got {kv_cache_manager.num_groups}"
            )
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.requests = requests
        self.block_size = kv_cache_manager.block_size
        self.failure_policy = failure_policy
        # Async loads that completed / that lost blocks (already rewound).
        self.finished_loads: set[str] = set()
        self.failed_loads: set[str] = set()
        # Requests started this step -> their computed tokens then (local
        # and connector hits). A synchronous load runs in this step: its
        # failure cuts back from there, and the connector hits are counted
        # once the step's output says what really loaded.
        self._started: dict[str, int] = {}
        # Requests parked in WAITING_FOR_REMOTE_KVS -> the tokens in place
        # once their load delivers (local hit + what the connector brings).
        # Only these count as computed: the last block's unread slots (a
        # partial block, or a request whose tokens grew before a
        # preemption) are never taken for delivered KV.
        self._loading: dict[str, int] = {}
        self.hit_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if connector is not None and log_stats else None
        )
        # Degradations since start (see SchedulerStats).
        self.num_ignored_completions = 0
        self.num_recomputed_tokens = 0
        # Replaced, never mutated, when it changes: report() hands it out.
        self.totals = KVConnectorStats()

    # ------------------------------------------------------------------
    # As the scheduler decides
    # ------------------------------------------------------------------

    # -- the connector's scheduler side: the scheduler calls it only here --

    @property
    def has_connector(self) -> bool:
        return self.connector is not None

    def request_added(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.request_added(request)

    def external_hit(self, request: Request, num_local: int) -> tuple[int | None, bool]:
        """Tokens past the local hit the connector can bring (None: it does
        not know yet, ask next step) and whether it loads them asynchronously."""
        if self.connector is None or request.skip_reading_prefix_cache:
            return 0, False
        return self.connector.get_num_new_matched_tokens(request, num_local)

    def blocks_allocated(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, blocks, num_external)

    def connector_metadata(self, output: SchedulerOutput) -> KVConnectorMetadata | None:
        """What the workers' connectors do this step."""
        return None if self.connector is None else self.connector.build_connector_meta(output)

    def take_events(self) -> list[KVCacheEvent]:
        return [] if self.connector is None else self.connector.take_events()

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()

    # -- the scheduler's record of transfers --

    def request_started(self, request_id: str, num_computed_tokens: int) -> None:
        """It starts with this many tokens in place (local and connector
        hits); a synchronous load's failure cuts back from there."""
        if self.connector is not None:
            self._started[request_id] = num_computed_tokens

    def load_started(self, request_id: str, num_tokens: int) -> None:
        """An asynchronous load began that leaves ``num_tokens`` of the
        request in place when it delivers."""
        self._loading[request_id] = num_tokens

    def request_finished(self, request: Request) -> tuple[bool, KVTransferParams | None]:
        """Tell the connector; returns (whether it holds the blocks while
        it sends them, the kv_transfer_params for the output)."""
        self._loading.pop(request.request_id, None)
        if self.connector is None:
            return False, None
        (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)
        return self.connector.request_finished(request, block_ids)

    def release_held(self, request_ids: Iterable[str]) -> None:
        """Nobody will read the blocks held for these finished requests.
        Only the connector knows whether something still reads them: it
        frees them through finished_sending."""
        if self.connector is None:
            return
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and request.is_finished():
                self.connector.request_released(request)

    def load_ready(self, request: Request) -> bool:
        """True once the request's async load finished; its loaded blocks are
        then cached and num_computed_tokens set to what arrived."""
        request_id = request.request_id
        if request_id not in self.finished_loads:
            return False
        kvm = self.kv_cache_manager
        delivered = self._loading.pop(request_id, 0)
        if request_id in self.failed_loads:
            # num_computed_tokens was already cut back to the valid prefix.
            if request.num_computed_tokens:
                kvm.cache_blocks(request, request.num_computed_tokens)
            else:
                kvm.free(request)  # nothing valid; a local hit may do better
            self.failed_loads.remove(request_id)
        else:
            # The last token is always computed here.
            num_computed = min(delivered, request.num_tokens - 1)
            kvm.cache_blocks(request, num_computed)
            request.num_computed_tokens = num_computed
        self.finished_loads.remove(request_id)
        return True

    def pending(self) -> bool:
        """Whether a transfer may still change what fits: a connector holds
        a finished request's blocks (finished_sending frees them), or an
        asynchronous load has not finished."""
        finished_loads = self.finished_loads
        for request in self.requests.values():
            if request.is_finished():
                return True
            if (
                request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and request.request_id not in finished_loads
            ):
                return True
        return False

    def release_one_parked(self, queue: Iterable[Request], keep: Request | None, why: str) -> bool:
        """The deadlock breaker's action: the least urgent request in
        ``queue`` (waiting requests in queue order; never ``keep``) that
        holds the blocks of a finished load gives them back and starts over
        (what it loaded stays in the prefix cache). Returns whether one
        did."""
        for request in reversed(list(queue)):
            request_id = request.request_id
            if request is keep or not self.kv_cache_manager.num_blocks(request_id):
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Only once its transfer stopped writing into the blocks;
                # this also offers what arrived to the prefix cache.
                if not self.load_ready(request):
                    continue
                request.ready_to_admit()
            logger.warning(
                "releasing the blocks of waiting request %s to avoid a deadlock: %s",
                request_id,
                why,
            )
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.num_external_computed_tokens = 0
            return True
        return False

    # ------------------------------------------------------------------
    # A step's output
    # ------------------------------------------------------------------

    def output_received(
        self,
        kv_output: KVConnectorOutput | None,
        running: list[Request],
        waiting: Iterable[Request],
    ) -> set[str]:
        """Before the step's tokens are applied: rewind the requests whose
        loaded KV was lost, add the connector's stats, count the hits of the
        requests started this step. Returns the running requests whose
        tokens this step are void."""
        void: set[str] = set()
        if kv_output is not None:
            if kv_output.invalid_block_ids:
                void = self._handle_invalid_blocks(kv_output.invalid_block_ids, running, waiting)
            if kv_output.stats is not None and not kv_output.stats.is_empty():
                totals = self.totals.copy()
                totals.add(kv_output.stats)
                self.totals = totals
        if self._started:
            self._record_hits()
            self._started.clear()
        return void

    def completions(self, kv_output: KVConnectorOutput) -> list[Request]:
        """After the step's tokens: note the loads that finished; returns
        the finished requests whose sends finished (their blocks can go)."""
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)
        requests = self.requests
        for req_id in kv_output.finished_recving or ():
            request = requests.get(req_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                logger.warning("ignoring KV load completion for unknown request %s", req_id)
                self.num_ignored_completions += 1
                continue
            self.finished_loads.add(req_id)
        sent: list[Request] = []
        for req_id in kv_output.finished_sending or ():
            request = requests.get(req_id)
            if request is None or not request.is_finished():
                logger.warning("ignoring KV send completion for unknown request %s", req_id)
                self.num_ignored_completions += 1
                continue
            sent.append(request)
        return sent

    def take_failed_loads(self, void: set[str]) -> set[str]:
        """Policy "fail": the requests whose load lost blocks, to be ended
        with an error instead of recomputing (``void``: this step's sync
        loads). An asynchronous load fails only once it has finished, so
        nothing writes into blocks after they are freed."""
        if self.failure_policy != "fail" or not (void or self.failed_loads):
            return set()
        failed = void | (self.failed_loads & self.finished_loads)
        self.failed_loads -= failed
        self.finished_loads -= failed
        return failed

    def report(self, stats: SchedulerStats) -> None:
        """Fill in the transfer counts; the hit counts start afresh."""
        if self.hit_stats is not None:
            stats.connector_prefix_cache_stats = self.hit_stats
            self.hit_stats = PrefixCacheStats()
        stats.num_ignored_kv_completions = self.num_ignored_completions
        stats.num_kv_recomputed_tokens = self.num_recomputed_tokens
        stats.kv_connector_totals = self.totals

    # ------------------------------------------------------------------
    # Lost blocks
    # ------------------------------------------------------------------

    def _record_hits(self) -> None:
        """Count the connector hits of the requests started this step, now
        that a failed load has taken its lost tokens off them."""
        stats = self.hit_stats
        if stats is None:
            return
        for req_id in self._started:
            request = self.requests.get(req_id)
            if request is None:
                continue
            stats.record(
                request.num_tokens,
                request.num_external_computed_tokens,
                request.num_preemptions > 0,
            )

    def _handle_invalid_blocks(
        self, invalid_block_ids: set[int], running: list[Request], waiting: Iterable[Request]
    ) -> set[str]:
        """Rewind requests whose loaded KV is invalid so it is recomputed.
        Returns the running requests whose output this step is void."""
        async_reqs = [r for r in waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        async_affected, async_tokens = self._rewind_invalid(async_reqs, invalid_block_ids)
        # They are rescheduled once their (partly failed) load completes.
        self.failed_loads |= async_affected
        sync_affected, sync_tokens = self._rewind_invalid(running, invalid_block_ids)
        if async_affected or sync_affected:
            logger.warning(
                "recovered from KV load failure: %d request(s) rescheduled, %d tokens to recompute",
                len(async_affected) + len(sync_affected),
                async_tokens + sync_tokens,
            )
        if self.failure_policy == "recompute":
            self.num_recomputed_tokens += async_tokens + sync_tokens
        return sync_affected

    def _rewind_invalid(
        self, requests: Iterable[Request], invalid_block_ids: set[int]
    ) -> tuple[set[str], int]:
        """Cut each request's computed tokens back to before its first
        invalid block. A block shared by several requests is recomputed by
        the first; the others only wait for it. Returns (affected request
        ids, tokens whose loaded KV was lost and is recomputed)."""
        affected: set[str] = set()
        total_tokens = 0
        claimed: set[int] = set()  # invalid blocks some request recomputes
        for request in requests:
            req_id = request.request_id
            (block_ids,) = self.kv_cache_manager.get_block_ids(req_id)
            valid_tokens = self._valid_tokens(request)
            num_blocks = -(-valid_tokens // self.block_size)
            is_affected = claimed_one = False
            for idx, block_id in enumerate(block_ids[:num_blocks]):
                if block_id not in invalid_block_ids:
                    continue
                is_affected = True
                if block_id in claimed:
                    continue
                claimed.add(block_id)
                if claimed_one:
                    continue
                claimed_one = True
                request.num_computed_tokens = idx * self.block_size
                lost = valid_tokens - request.num_computed_tokens
                total_tokens += lost
                # The connector's tokens are the tail of the valid ones: the
                # lost come off them first, never below zero. More can be
                # lost than it supplied (a local hit on a block a failed
                # load shared; vLLM also counted an async load's last block
                # whole, and a resumed request's first start): vLLM's plain
                # subtraction went negative, and the hit count with it.
                request.num_external_computed_tokens = max(
                    0, request.num_external_computed_tokens - lost
                )
            if is_affected:
                if not claimed_one:
                    # Every bad block is recomputed by an earlier request
                    # (counted there); this one redoes only this step.
                    request.num_computed_tokens = valid_tokens
                affected.add(req_id)
        return affected, total_tokens

    def _valid_tokens(self, request: Request) -> int:
        """The leading tokens a request counts as computed, of which a
        failed load may take some back."""
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            # A synchronous load: what the request started this step with.
            # (vLLM takes num_cached_tokens, which a resumed request set
            # when it first started: more than it may have now.)
            return self._started.get(request.request_id, request.num_cached_tokens)
        if request.request_id in self.failed_loads:
            return request.num_computed_tokens  # already cut by an earlier failure
        # What the async load brings, as load_ready counts it.
        return min(self._loading.get(request.request_id, 0), request.num_tokens - 1)
