"""A KV connector over a content-addressed block store (Redis, shared memory).

Scheduler half: for each new request, how many blocks past the local prefix
hit the store holds (its longest stored prefix), and, as steps complete full
blocks, which of them to save. A P/D consumer (``do_remote_prefill``) does
not look up at all: the producer saved every full prompt block, so it loads
them asynchronously, waiting up to ``load_wait_seconds`` for late ones.

Worker half: synchronous loads run before the forward; asynchronous loads
and all saves run on a ``TransferThread``. After the forward, the blocks to
save are copied out of the cache (so the scheduler may reuse them at once)
and handed to the thread; finished asynchronous loads are copied into the
cache on the step thread, then reported in ``finished_recving``.

Extra config (``kv_connector_extra_config``): ``StoreOptions`` below,
``load_async`` (bool: load hits in the background; default per store) and
``load_wait_seconds`` (float, default 10), which each store's options extend.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from connectors.block_codec import BlockCodec
from connectors.kv_blocks import FrameBuffers, KVBlockIO
from connectors.store import (
    RETAINED_FRAME_BYTES,
    BlockStore,
    LoadJob,
    LoadResult,
    TransferThread,
    direct_store,
    load_into_cache,
    stage_save,
)
from engine.kv_transfer.base import (
    ConnectorContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from engine.kv_transfer.options import ConnectorOptions, option
from engine.kv_transfer.params import KVTransferParams
from engine.stats import KVConnectorStats, TransferFailure

if TYPE_CHECKING:
    from engine.kv_cache.manager import KVCacheBlocks
    from engine.outputs import KVConnectorOutput
    from engine.request import Request
    from engine.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

# Block hashes the scheduler half believes stored, so a block is saved once.
_KNOWN_CAPACITY = 1 << 16


@dataclass(frozen=True)
class StoreOptions(ConnectorOptions):
    """The keys every store connector takes (a store's options add its own)."""

    load_async: bool | None = option(
        None, "load hits in the background (null: the store's default_load_async)"
    )
    load_wait_seconds: float = option(
        10.0, "P/D consumer: how long to wait for blocks its producer has not saved yet"
    )


@dataclass
class LoadSpec:
    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    is_async: bool
    wait_for_producer: bool = False


@dataclass
class StoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    # (block id, block hash) of every block this step completes and should save.
    saves: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-half state of one live request."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # leading blocks saved, or known to be stored


class StoreConnector(KVConnectorBase):
    """Subclasses name the store: ``make_store`` and ``default_load_async``."""

    default_load_async = True
    options_class: ClassVar[type[StoreOptions]] = StoreOptions

    def __init__(self, role: KVConnectorRole, context: ConnectorContext) -> None:
        super().__init__(role, context)
        options = self.options_class.of(context.config)
        self.codec = BlockCodec(context.model_name, context.layout)
        self.block_size = context.layout.block_size
        self.is_producer = context.config.is_producer
        self.is_consumer = context.config.is_consumer
        self.load_async = (
            self.default_load_async if options.load_async is None else options.load_async
        )
        self.load_wait_seconds = options.load_wait_seconds
        self.store = self.make_store(context)
        # scheduler half
        self._tracked: dict[str, _Tracked] = {}
        self._local_tokens: dict[str, int] = {}
        # request id -> (first block looked up, its hashes, which are stored)
        self._lookups: dict[str, tuple[int, list[bytes], Future[list[bool]]]] = {}
        self._lookup_pool: ThreadPoolExecutor | None = None
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._pending_loads: list[LoadSpec] = []
        # Loads not yet reported done, to map invalid block ids to hashes.
        self._inflight: dict[str, LoadSpec] = {}
        # Stored blocks that failed to load: never loaded again until re-saved.
        self._bad: OrderedDict[bytes, None] = OrderedDict()
        # Requests whose load failed: no second remote-prefill attempt.
        self._failed_reqs: set[str] = set()
        # worker half
        self._io: KVBlockIO | None = None
        self._thread: TransferThread | None = None
        # Frame arrays reused across saves and loads (nothing until used).
        self._buffers = FrameBuffers(self.codec.frame_bytes, RETAINED_FRAME_BYTES)
        self._async_loads: dict[str, LoadSpec] = {}
        # Requests that finished while their async load ran.
        self._orphaned: set[str] = set()
        self._invalid: set[int] = set()
        # Failed loads and saves since take_stats last ran.
        self._stats = KVConnectorStats()
        self._failed_save_jobs_seen = 0

    @abstractmethod
    def make_store(self, context: ConnectorContext) -> BlockStore: ...

    # ==== scheduler half ===================================================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        self._tracked.setdefault(req_id, _Tracked(request))
        self._local_tokens[req_id] = num_computed_tokens
        if not self.is_consumer:
            return 0, False
        first = num_computed_tokens // self.block_size
        # The last prompt token is always computed, so its block never loads.
        last = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        if last <= first:
            return 0, False
        if self._wants_remote_prefill(request):
            # The producer says how many leading blocks it saved.
            saved = request.kv_transfer_params.num_blocks if request.kv_transfer_params else None
            last = last if saved is None else min(last, saved)
            return max(0, last - first) * self.block_size, last > first
        hits = self._stored_prefix(request, first, last)
        if hits is None:
            return None, False
        return hits * self.block_size, self.load_async and hits > 0

    def _stored_prefix(self, request: Request, first: int, last: int) -> int | None:
        """Blocks first..last-1 present in the store, counted from `first`;
        None while a lookup on the network is in flight."""
        hashes = request.block_hashes[first:last]
        bad = next((i for i, h in enumerate(hashes) if h in self._bad), None)
        if bad is not None:
            hashes = hashes[:bad]
            last = first + bad
        if self.store.local_lookups:
            return self._present_prefix(hashes, self.store.contains_many(hashes))
        req_id = request.request_id
        entry = self._lookups.get(req_id)
        # A lookup from a smaller local hit still answers (the blocks it
        # counted past `first` are what matter); one from a larger hit (the
        # local blocks were evicted since) does not cover `first`: redo it.
        if entry is None or entry[0] > first:
            if self._lookup_pool is None:
                self._lookup_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-lookup")
            future = self._lookup_pool.submit(self.store.contains_many, hashes)
            self._lookups[req_id] = (first, hashes, future)
            return None
        start, asked, future = entry
        if not future.done():
            return None
        found = self._present_prefix(asked, future.result())
        return max(0, min(last, start + found) - first)

    def _present_prefix(self, hashes: list[bytes], present: list[bool]) -> int:
        """How many leading blocks the store holds. A block it lacks is
        forgotten as saved (a store restarted empty, an eviction), so the
        next time it is computed it is saved again."""
        for block_hash, here in zip(hashes, present, strict=True):
            if not here:
                self._known.pop(block_hash, None)
        return _leading_true(present)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        tracked = self._tracked.setdefault(req_id, _Tracked(request))
        local = self._local_tokens.pop(req_id, request.num_computed_tokens)
        first = local // self.block_size
        count = num_external_tokens // self.block_size
        # What came from the cache or the store need not be saved again.
        tracked.saved_blocks = first + count
        if count == 0:
            return
        (all_ids,) = blocks.get_block_ids()  # connectors run with one KV cache group
        block_ids = all_ids[first : first + count]
        remote = self._wants_remote_prefill(request)
        spec = LoadSpec(
            req_id,
            block_ids,
            request.block_hashes[first : first + count],
            is_async=remote or self.load_async,
            wait_for_producer=remote,
        )
        self._pending_loads.append(spec)
        self._inflight[req_id] = spec

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreConnectorMetadata:
        meta = StoreConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        # Synchronous loads of earlier steps were reported with their step's
        # output; forget them before their block ids are reused.
        current = {id(spec) for spec in meta.loads}
        for req_id, spec in list(self._inflight.items()):
            if not spec.is_async and id(spec) not in current:
                del self._inflight[req_id]
        self._track_blocks(scheduler_output)
        if self.is_producer:
            for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
                tracked = self._tracked.get(req_id)
                if tracked is not None:
                    meta.saves.extend(self._blocks_to_save(tracked, num_new))
        return meta

    def _track_blocks(self, so: SchedulerOutput) -> None:
        for new in so.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                (tracked.block_ids,) = (list(ids) for ids in new.block_ids)
        cached = so.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])

    def _blocks_to_save(self, tracked: _Tracked, num_new: int) -> list[tuple[int, bytes]]:
        request = tracked.request
        full = (request.num_computed_tokens + num_new) // self.block_size
        full = min(full, len(request.block_hashes), len(tracked.block_ids))
        saves = []
        for idx in range(tracked.saved_blocks, full):
            block_hash = request.block_hashes[idx]
            if block_hash in self._known:
                self._known.move_to_end(block_hash)
                continue
            self._known[block_hash] = None
            self._bad.pop(block_hash, None)  # this save replaces the bad copy
            saves.append((tracked.block_ids[idx], block_hash))
        tracked.saved_blocks = max(tracked.saved_blocks, full)
        while len(self._known) > _KNOWN_CAPACITY:
            self._known.popitem(last=False)
        return saves

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn which stored blocks failed to load, so no request is sent
        to load them again (a bad block would otherwise be looked up, loaded
        and rejected forever); our next save of that block replaces it."""
        invalid = connector_output.invalid_block_ids
        done = connector_output.finished_recving or set()
        for req_id, spec in list(self._inflight.items()):
            bad = [h for b, h in zip(spec.block_ids, spec.hashes, strict=True) if b in invalid]
            for block_hash in bad:
                self._bad[block_hash] = None
                self._known.pop(block_hash, None)
            if bad:
                self._failed_reqs.add(req_id)
            if not spec.is_async or req_id in done:
                del self._inflight[req_id]
        while len(self._bad) > _KNOWN_CAPACITY:
            self._bad.popitem(last=False)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        req_id = request.request_id
        tracked = self._tracked.pop(req_id, None)
        self._local_tokens.pop(req_id, None)
        spec = self._inflight.pop(req_id, None)
        self._failed_reqs.discard(req_id)
        entry = self._lookups.pop(req_id, None)
        if entry is not None:
            entry[2].cancel()
        # Finished (aborted) while its asynchronous load still runs: the
        # blocks stay allocated until the worker reports the load over (in
        # finished_sending), so the transfer never writes into reused blocks.
        # Saves hold nothing: the blocks were copied out when computed.
        delay_free = spec is not None and spec.is_async
        params = request.kv_transfer_params
        if not (self.is_producer and params is not None and params.do_remote_decode):
            return delay_free, None
        saved = tracked.saved_blocks if tracked is not None else 0
        assert self.context is not None
        return delay_free, KVTransferParams(
            do_remote_prefill=True,
            kv_connector=self.context.config.kv_connector,
            remote_engine_id=self.context.engine_id,
            num_blocks=saved,
        )

    def _wants_remote_prefill(self, request: Request) -> bool:
        """A P/D consumer's first attempt; after a failed load the request
        looks up like any other (and recomputes what is bad)."""
        params = request.kv_transfer_params
        wants = bool(params is not None and params.do_remote_prefill)
        return wants and request.request_id not in self._failed_reqs

    # ==== worker half ======================================================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._io = KVBlockIO(list(kv_caches.values()))
        self._thread = TransferThread(
            self.store,
            self.codec,
            name="kv-transfer",
            verify_in_copy=self._io.copies_rows,
            buffers=self._buffers,
        )

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._metadata
        if not isinstance(meta, StoreConnectorMetadata) or not meta.loads:
            return
        assert self._io is not None and self._thread is not None
        for spec in meta.loads:
            job = LoadJob(spec.req_id, spec.hashes, spec.block_ids)
            if spec.is_async:
                if spec.wait_for_producer:
                    job.wait_until = time.monotonic() + self.load_wait_seconds
                self._async_loads[spec.req_id] = spec
                self._thread.submit_load(job)
            else:
                result = load_into_cache(self.store, self.codec, self._io, job, self._buffers)
                self._invalid.update(result.failed_block_ids)
                self._count_failures(result)

    def wait_for_save(self) -> None:
        meta = self._metadata
        if not isinstance(meta, StoreConnectorMetadata) or not meta.saves:
            return
        assert self._io is not None and self._thread is not None
        block_ids = [b for b, _ in meta.saves]
        hashes = [h for _, h in meta.saves]
        direct = direct_store(self.store, self._io)
        if direct is not None:
            direct.save_direct(self._io, hashes, block_ids)  # one copy, in place
            return
        # The checksums come with the copy (where compiled): the transfer
        # thread then only writes headers and sends.
        self._thread.submit_save(stage_save(self._io, hashes, block_ids, self._buffers))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests finished while loading whose load is now over: their
        blocks may go; requests whose load finished)."""
        if self._thread is None:
            return None, None
        self._orphaned |= finished_req_ids & self._async_loads.keys()
        done: set[str] = set()
        released: set[str] = set()
        for result in self._thread.take_results():
            self._async_loads.pop(result.req_id, None)
            if result.req_id in self._orphaned:
                self._orphaned.discard(result.req_id)
                released.add(result.req_id)  # nobody waits for these blocks
                self._buffers.give_back(result.frames)
                continue
            self._apply(result)
            done.add(result.req_id)
        return released or None, done or None

    def _apply(self, result: LoadResult) -> None:
        assert self._io is not None
        result.apply(self._io, self._buffers)
        self._invalid.update(result.failed_block_ids)
        self._count_failures(result)

    def _count_failures(self, result: LoadResult) -> None:
        """One failed load per request and kind; a store that does not say
        why a block failed (the direct shared-memory path) counts a miss."""
        if not result.failed_block_ids:
            return
        for kind in result.failure_kinds or {TransferFailure.MISSING}:
            self._stats.add_failure(kind)

    def take_stats(self) -> KVConnectorStats | None:
        if self._thread is not None:
            failed_saves = self._thread.failed_save_jobs
            if failed_saves > self._failed_save_jobs_seen:
                self._stats.add_failure(
                    TransferFailure.SAVE_FAILED, failed_saves - self._failed_save_jobs_seen
                )
                self._failed_save_jobs_seen = failed_saves
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVConnectorStats()
        return stats

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def health(self) -> str | None:
        return self._thread.health() if self._thread is not None else None

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.close()
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()


def _leading_true(flags: list[bool]) -> int:
    for i, present in enumerate(flags):
        if not present:
            return i
    return len(flags)
