"""Content-addressed block stores and the thread that talks to one.

A ``BlockStore`` keeps framed KV blocks (``connectors.block_codec``) under
their block hashes. Its calls may block on I/O, so the connector calls them
only from ``TransferThread`` (and, for a store whose lookups are local
memory operations, from the scheduler: ``local_lookups``).

``TransferThread`` runs saves and loads off the step loop, in order. A load
can wait for its blocks to appear (a decode pod whose prefill pod is still
writing them) without holding up the loads behind it: waiting loads are
re-checked each pass until their deadline, then load what is there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from connectors.block_codec import HEADER_BYTES, BlockCodec, FrameError
from connectors.kv_blocks import Frames, KVBlockIO

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
        """Stores the frames; False if the store could not take them."""
        ...

    def close(self) -> None: ...


@dataclass
class SaveJob:
    hashes: list[bytes]
    frames: Frames  # one frame per hash, a row each; save_blocks seals them


@dataclass
class LoadJob:
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    # Until this monotonic time, wait for missing blocks to appear.
    wait_until: float = 0.0


@dataclass
class LoadResult:
    """A load's verified frames (rows, in ``block_ids`` order) and the
    blocks that failed."""

    req_id: str
    block_ids: list[int] = field(default_factory=list)
    frames: Frames = field(default_factory=lambda: np.empty((0, 0), np.uint8))
    failed_block_ids: list[int] = field(default_factory=list)

    def apply(self, io: KVBlockIO) -> None:
        """Write the verified frames into the cache (on the step thread)."""
        if self.block_ids:
            io.scatter_frames(self.block_ids, self.frames, HEADER_BYTES)


def load_blocks(store: BlockStore, codec: BlockCodec, job: LoadJob) -> LoadResult:
    """Fetch and verify a job's blocks. A block after a missing or bad one is
    still used: the scheduler recomputes from the first failed block, and
    whatever it finds valid stays in the prefix cache."""
    result = LoadResult(job.req_id)
    frames: Frames = np.empty((len(job.hashes), codec.frame_bytes), np.uint8)
    lengths = store.read_into(job.hashes, frames)
    good: list[int] = []
    for i, (block_id, block_hash, length) in enumerate(
        zip(job.block_ids, job.hashes, lengths, strict=True)
    ):
        if length < 0:
            result.failed_block_ids.append(block_id)
            continue
        try:
            if length != codec.frame_bytes:
                raise FrameError(f"frame of {length} bytes, expected {codec.frame_bytes}")
            codec.check(frames[i].data)
        except FrameError as e:
            logger.warning("KV block %s is unusable (%s): recomputing it", block_hash.hex(), e)
            result.failed_block_ids.append(block_id)
            continue
        good.append(i)
    result.block_ids = [job.block_ids[i] for i in good]
    result.frames = frames if len(good) == len(job.hashes) else frames[good]
    return result


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
    return store if isinstance(store, DirectStore) and io.copies_rows else None


def load_into_cache(
    store: BlockStore, codec: BlockCodec, io: KVBlockIO, job: LoadJob
) -> LoadResult:
    """A synchronous load: on return the good blocks are in the cache; the
    result lists the failed ones."""
    direct = direct_store(store, io)
    if direct is not None:
        return direct.load_direct(io, job)
    result = load_blocks(store, codec, job)
    result.apply(io)
    return result


def save_blocks(store: BlockStore, codec: BlockCodec, job: SaveJob) -> bool:
    """Seal the job's frames (headers and checksums) and store them."""
    codec.seal(job.frames)
    return store.put_many([(h, row.data) for h, row in zip(job.hashes, job.frames, strict=True)])


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

    def __init__(self, store: BlockStore, codec: BlockCodec, name: str) -> None:
        self.store = store
        self.codec = codec
        self._jobs: queue.SimpleQueue[SaveJob | LoadJob | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self._waiting: list[LoadJob] = []
        self._busy_since: float | None = None
        self._died: str | None = None
        self.saved_blocks = 0
        self.failed_saves = 0
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
                if save_blocks(self.store, self.codec, job):
                    self.saved_blocks += len(job.hashes)
                else:
                    self.failed_saves += len(job.hashes)
            elif job.wait_until > time.monotonic() and not all(
                self.store.contains_many(job.hashes)
            ):
                self._waiting.append(job)
            else:
                self._results.put(load_blocks(self.store, self.codec, job))
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
