"""Content-addressed block stores and the thread that talks to one.

A ``BlockStore`` keeps framed KV blocks (``connectors.block_codec``) under
their block hashes. Its calls may block on I/O, so the connector calls them
only from ``TransferThread`` (and, for a store whose lookups are local
memory operations, from the scheduler: ``local_lookups``).

``TransferThread`` runs saves and loads off the step loop, in order. A load
can wait for its blocks to appear (a decode pod whose prefill pod is still
writing them) without holding up the loads behind it: waiting loads are
re-checked each pass until their deadline, then load what is there.

Checksums ride with the copies where the compiled block copies are built
(``KVBlockIO.copies_rows``): a save's gather computes them (``stage_save``)
and the transfer thread only writes the headers; a load checks the headers
on the transfer thread (each against the block hash it was read under, so
a frame stored under another block's key fails) and verifies each payload
as it is copied into the cache (``LoadResult.apply``). A block that fails
is never copied in, and counts as ``corrupt``. Frame arrays come from, and
go back to, a ``FrameBuffers``.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast, runtime_checkable

import numpy as np

from connectors.block_codec import HEADER_BYTES, BlockCodec, FrameError
from connectors.kv_blocks import FrameBuffers, Frames, KVBlockIO
from engine.stats import TransferFailure

logger = logging.getLogger(__name__)


class BlockStore(Protocol):
    """Frames by block hash. Every method may block; none may raise for a
    store that is down: it reports misses (``None`` / ``False``) and drops
    writes, and says so through ``last_error``."""

    # True when contains_many is a local memory lookup that never waits.
    local_lookups: bool
    last_error: str | None

    def contains_many(self, hashes: Sequence[bytes]) -> list[bool]: ...

    def read_into(self, hashes: Sequence[bytes], frames: Frames) -> list[int]:
        """Copies each stored frame into its row of ``frames`` and returns
        its length, or -1 if absent. A frame longer than a row is not copied
        (its length still tells the caller it is unusable)."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> bool:
        """Stores the frames; False if the store could not take them. The
        frames' memory is reused once it returns: a store copies what it keeps."""
        ...

    def close(self) -> None: ...


# How many bytes of frame arrays a connector keeps for reuse: a few batches
# of an ordinary step, or one long prompt's blocks.
RETAINED_FRAME_BYTES = 1 << 30


@dataclass
class SaveJob:
    hashes: list[bytes]
    frames: Frames  # one frame per hash, a row each; save_blocks seals them
    # The payloads' xxh3-64, where the gather computed them.
    checksums: list[int] | None = None


@dataclass
class LoadJob:
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    # Until this monotonic time, wait for missing blocks to appear.
    wait_until: float = 0.0


_NO_FRAMES: Frames = np.empty((0, 0), np.uint8)  # shared: a load with nothing to copy


@dataclass
class LoadResult:
    """A load's fetched frames (``frames[rows[j]]`` for ``block_ids[j]``),
    their header-stated checksums where still to be verified (in the copy
    into the cache), the blocks that failed and why (each kind once)."""

    req_id: str
    block_ids: list[int] = field(default_factory=list)
    frames: Frames = field(default_factory=lambda: _NO_FRAMES)
    rows: list[int] = field(default_factory=list)
    checksums: list[int] | None = None
    failed_block_ids: list[int] = field(default_factory=list)
    failure_kinds: set[TransferFailure] = field(default_factory=set)

    def apply(self, io: KVBlockIO, buffers: FrameBuffers | None = None) -> None:
        """Write the good frames into the cache (on the step thread); a
        frame that fails its checksum here joins ``failed_block_ids``.
        The frames go back to ``buffers`` after."""
        if self.block_ids and self.checksums is None:
            io.scatter_frames(self.block_ids, self._good_frames(), HEADER_BYTES)
        elif self.block_ids and self.checksums is not None:
            mismatched = io.scatter_rows_xxh3(
                self.block_ids, self.frames, self.rows, HEADER_BYTES, self.checksums
            )
            self._drop(mismatched)
        if buffers is not None:
            buffers.give_back(self.frames)
        self.frames = _NO_FRAMES

    def _good_frames(self) -> Frames:
        if self.rows == list(range(len(self.frames))):
            return self.frames
        return self.frames[self.rows]

    def _drop(self, mismatched: list[int]) -> None:
        """Move the blocks at these positions, which failed their checksum
        in the copy (and were not written), to the failed ones."""
        for j in mismatched:
            logger.warning("KV block %d failed its checksum: recomputing it", self.block_ids[j])
        if mismatched:
            self.failure_kinds.add(TransferFailure.CORRUPT)
        self.failed_block_ids += [self.block_ids[j] for j in mismatched]
        drop = set(mismatched)
        self.block_ids = [b for j, b in enumerate(self.block_ids) if j not in drop]


def load_blocks(
    store: BlockStore,
    codec: BlockCodec,
    job: LoadJob,
    *,
    verify_in_copy: bool = False,
    buffers: FrameBuffers | None = None,
) -> LoadResult:
    """Fetch a job's blocks and check their frames; with ``verify_in_copy``
    (compiled copies only) the checksums are verified by ``apply``, in the
    copy into the cache. A block after a missing or bad one is still used:
    the scheduler recomputes from the first failed block, and whatever it
    finds valid stays in the prefix cache."""
    n = len(job.hashes)
    frames = buffers.take(n) if buffers is not None else np.empty((n, codec.frame_bytes), np.uint8)
    lengths = store.read_into(job.hashes, frames)
    # An absent block is a miss, unless the read itself failed (store down).
    absent = TransferFailure.STORE_ERROR if store.last_error else TransferFailure.MISSING
    # Each frame is checked against the key it was read under: another
    # key's frame (a swap, a mix-up) fails here like a corrupt one.
    stated = codec.check_headers(frames, range(n), lengths, job.hashes)
    result = LoadResult(job.req_id, frames=frames, checksums=[] if verify_in_copy else None)
    for i, (block_id, block_hash) in enumerate(zip(job.block_ids, job.hashes, strict=True)):
        checksum = stated[i]
        if checksum is None:
            _log_unusable(codec, frames[i], lengths[i], block_hash)
        elif result.checksums is not None:
            result.checksums.append(checksum)  # verified in the copy (apply)
        elif not _checksum_ok(codec, frames[i], block_hash):
            checksum = None
        if checksum is None:
            result.failed_block_ids.append(block_id)
            result.failure_kinds.add(absent if lengths[i] < 0 else TransferFailure.CORRUPT)
        else:
            result.rows.append(i)
            result.block_ids.append(block_id)
    return result


def _log_unusable(codec: BlockCodec, frame: Frames, length: int, block_hash: bytes) -> None:
    if length < 0:
        return  # absent: not worth a warning
    if length > codec.frame_bytes:  # too long to have been copied
        error = FrameError(f"frame of {length} bytes, expected {codec.frame_bytes}")
    else:
        error = codec.header_error(frame[:length].data, block_hash)
    logger.warning("KV block %s is unusable (%s): recomputing it", block_hash.hex(), error)


def _checksum_ok(codec: BlockCodec, frame: Frames, block_hash: bytes) -> bool:
    try:
        codec.check(frame.data, block_hash)
    except FrameError as e:
        logger.warning("KV block %s is unusable (%s): recomputing it", block_hash.hex(), e)
        return False
    return True


@runtime_checkable
class DirectStore(Protocol):
    """A store in this process's memory (shared memory) that copies between
    the cache and its slots itself: no staging frames, no transfer thread."""

    def save_direct(
        self, io: KVBlockIO, hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> None: ...

    def load_direct(self, io: KVBlockIO, job: LoadJob) -> LoadResult: ...


def direct_store(store: BlockStore, io: KVBlockIO) -> DirectStore | None:
    """The store's zero-copy side, where it has one and the compiled block
    copies are built."""
    if not (io.copies_rows and _has_direct_side(type(store))):
        return None
    return cast(DirectStore, store)


@functools.cache
def _has_direct_side(cls: type) -> bool:
    # Once per class: an isinstance check against a Protocol walks its
    # members each call (tens of microseconds, for every load and save).
    return issubclass(cls, DirectStore)


def load_into_cache(
    store: BlockStore,
    codec: BlockCodec,
    io: KVBlockIO,
    job: LoadJob,
    buffers: FrameBuffers | None = None,
) -> LoadResult:
    """A synchronous load: on return the good blocks are in the cache; the
    result lists the failed ones."""
    direct = direct_store(store, io)
    if direct is not None:
        return direct.load_direct(io, job)
    result = load_blocks(store, codec, job, verify_in_copy=io.copies_rows, buffers=buffers)
    result.apply(io, buffers)
    return result


def stage_save(
    io: KVBlockIO,
    hashes: list[bytes],
    block_ids: list[int],
    buffers: FrameBuffers | None = None,
) -> SaveJob:
    """Copy blocks out of the cache into frames (with their checksums, where
    compiled), so the cache may be reused at once; the job goes to
    ``save_blocks``."""
    if not io.copies_rows:
        return SaveJob(hashes, io.gather_frames(block_ids, HEADER_BYTES))
    n = len(block_ids)
    row_bytes = HEADER_BYTES + io.payload_bytes
    frames = buffers.take(n) if buffers is not None else np.empty((n, row_bytes), np.uint8)
    checksums = io.gather_rows_xxh3(block_ids, frames, None, HEADER_BYTES)
    return SaveJob(hashes, frames, checksums)


def save_blocks(
    store: BlockStore, codec: BlockCodec, job: SaveJob, buffers: FrameBuffers | None = None
) -> bool:
    """Seal the job's frames (headers and checksums, each frame bound to its
    block hash) and store them; the frames go back to ``buffers`` after."""
    codec.seal(job.frames, job.hashes, job.checksums)
    try:
        return store.put_many(
            [(h, row.data) for h, row in zip(job.hashes, job.frames, strict=True)]
        )
    finally:
        if buffers is not None:
            buffers.give_back(job.frames)


class TransferThread:
    """Saves and asynchronous loads, on one daemon thread.

    Thread-safe entry points: ``submit_save``, ``submit_load``,
    ``take_results``, ``health``, ``close``.
    """

    # A pass over waiting loads at most this often, so a load that waits on
    # its producer does not spin on the store.
    POLL_SECONDS = 0.005
    # A job that makes no progress for this long means the store is wedged.
    WEDGED_SECONDS = 60.0

    def __init__(
        self,
        store: BlockStore,
        codec: BlockCodec,
        name: str,
        *,
        verify_in_copy: bool = False,
        buffers: FrameBuffers | None = None,
    ) -> None:
        """``verify_in_copy``: leave loads' checksums to ``LoadResult.apply``
        (compiled copies); ``buffers``: where frame arrays come from and go
        back to."""
        self.store = store
        self.codec = codec
        self.verify_in_copy = verify_in_copy
        self.buffers = buffers
        self._jobs: queue.SimpleQueue[SaveJob | LoadJob | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self._waiting: list[LoadJob] = []
        self._busy_since: float | None = None
        self._died: str | None = None
        self.saved_blocks = 0
        self.failed_saves = 0  # blocks
        self.failed_save_jobs = 0  # only grows: readers diff it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit_save(self, job: SaveJob) -> None:
        self._jobs.put(job)

    def submit_load(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def take_results(self) -> list[LoadResult]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def health(self) -> str | None:
        if self._died is not None:
            return f"KV transfer thread died: {self._died}"
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.WEDGED_SECONDS:
            return f"KV transfer thread stuck on one job for over {self.WEDGED_SECONDS:.0f} s"
        return None

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued saves (up to ``timeout``), then stop."""
        self._jobs.put(None)
        self._thread.join(timeout)

    # ---- the thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # reported through health(); never silent
            self._died = f"{type(e).__name__}: {e}"
            logger.exception("KV transfer thread died")

    def _step(self) -> bool:
        """One pass: take new jobs, run them, re-check waiting loads.
        Returns False once closed."""
        try:
            job = self._jobs.get(timeout=self.POLL_SECONDS if self._waiting else None)
        except queue.Empty:
            job = None
        else:
            if job is None:
                self._fail_waiting()
                return False
        if job is not None:
            self._run_job(job)
        self._retry_waiting()
        return True

    def _run_job(self, job: SaveJob | LoadJob) -> None:
        self._busy_since = time.monotonic()
        try:
            if isinstance(job, SaveJob):
                if save_blocks(self.store, self.codec, job, self.buffers):
                    self.saved_blocks += len(job.hashes)
                else:
                    self.failed_saves += len(job.hashes)
                    self.failed_save_jobs += 1
            elif job.wait_until > time.monotonic() and not all(
                self.store.contains_many(job.hashes)
            ):
                self._waiting.append(job)
            else:
                self._results.put(
                    load_blocks(
                        self.store,
                        self.codec,
                        job,
                        verify_in_copy=self.verify_in_copy,
                        buffers=self.buffers,
                    )
                )
        finally:
            self._busy_since = None

    def _retry_waiting(self) -> None:
        if not self._waiting:
            return
        waiting, self._waiting = self._waiting, []
        for job in waiting:
            self._run_job(job)
        if self._waiting:
            time.sleep(self.POLL_SECONDS)

    def _fail_waiting(self) -> None:
        for job in self._waiting:
            self._results.put(LoadResult(job.req_id, failed_block_ids=list(job.block_ids)))
        self._waiting = []
