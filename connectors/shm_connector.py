"""SharedMemoryConnector: KV blocks in a POSIX shared-memory pool on one host.

For prefill and decode processes on the same machine, and as a CPU tier
under the GPU cache (``--kv-offload shm``). Blocks live in a fixed-size
``ShmBlockPool`` (``connectors.shm_pool``) with LRU eviction, shared by
every process that opens the same pool name; the last process to close it
removes the segments.

Lookups are local memory operations, so the scheduler asks the pool
directly; hits load synchronously before the forward by default (a memory
copy), and P/D consumers load asynchronously like any other connector.

Extra config (``kv_connector_extra_config``; ``ShmOptions`` below, plus
``StoreOptions``'s ``load_async`` and ``load_wait_seconds``):

* ``pool_name``: processes sharing blocks use the same name (default
  ``"tandem"``; the model's namespace is appended, so models never mix).
* ``capacity_bytes``: pool size (default 1 GiB); the pool holds
  ``capacity_bytes // frame size`` blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from connectors.block_codec import HEADER_BYTES, BlockCodec
from connectors.kv_blocks import Frames, KVBlockIO
from connectors.shm_pool import ShmBlockPool, ShmPoolConfig
from connectors.store import BlockStore, LoadJob, LoadResult
from connectors.store_connector import StoreConnector, StoreOptions
from engine.kv_transfer.base import ConnectorContext
from engine.kv_transfer.options import option
from engine.stats import TransferFailure
from kernels import cpu_kernels

DEFAULT_CAPACITY_BYTES = 1 << 30

logger = logging.getLogger(__name__)


class ShmBlockStore:
    local_lookups = True

    def __init__(self, codec: BlockCodec, pool_name: str, capacity_bytes: int) -> None:
        self.codec = codec
        num_slots = capacity_bytes // codec.frame_bytes
        if num_slots < 1:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} is invalid: a block frame takes "
                f"{codec.frame_bytes} bytes"
            )
        self.pool = ShmBlockPool(
            ShmPoolConfig(f"{pool_name}-{codec.namespace}", num_slots, codec.frame_bytes),
            cpu_kernels.load(),
        )
        self.last_error: str | None = None

    def _keys(self, hashes: Sequence[bytes]) -> list[bytes]:
        return [self.codec.digest_key(h) for h in hashes]

    def contains_many(self, hashes: Sequence[bytes]) -> list[bool]:
        return self.pool.contains_many(self._keys(hashes))

    def read_into(self, hashes: Sequence[bytes], frames: Frames) -> list[int]:
        # One copy, shared memory to the row, under the pool's lock.
        return self.pool.read_into(self._keys(hashes), [row.data for row in frames])

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> bool:
        self.pool.put_many([(self.codec.digest_key(h), frame) for h, frame in items])
        return True

    # ---- zero-copy paths (the step thread, compiled block copies) -----------

    def save_direct(self, io: KVBlockIO, hashes: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Copy blocks from the cache straight into pool slots and seal them
        there (each bound to its block hash): one pass (copy and checksum
        together), under the pool lock."""
        codec = self.codec

        def fill(data: Frames, indices: list[int], slots: list[int]) -> None:
            ids = [block_ids[i] for i in indices]
            checksums = io.gather_rows_xxh3(ids, data, slots, HEADER_BYTES)
            codec.seal_rows(data, slots, [hashes[i] for i in indices], checksums)

        self.pool.write_with(self._keys(hashes), codec.frame_bytes, fill)

    def load_direct(self, io: KVBlockIO, job: LoadJob) -> LoadResult:
        """Verify blocks in the pool and copy them straight into the cache,
        under the pool lock: headers first (each against the block hash
        asked for: a slot holding another block's frame is bad), then each
        checksum in the copy (a block that fails it is not copied). Absent
        or bad blocks are reported failed."""
        good: list[int] = []
        unusable: list[int] = []  # present but bad (the rest of the failed are absent)

        def use(data: Frames, indices: list[int], slots: list[int], lengths: list[int]) -> None:
            sound: list[tuple[int, int]] = []  # (k, checksum its header states)
            asked = [job.hashes[i] for i in indices]
            for k, checksum in enumerate(self.codec.check_headers(data, slots, lengths, asked)):
                if checksum is None:
                    self._log_unusable(job.hashes[indices[k]], data[slots[k], : lengths[k]])
                    unusable.append(k)
                else:
                    sound.append((k, checksum))
            if not sound:
                return
            mismatched = set(
                io.scatter_rows_xxh3(
                    [job.block_ids[indices[k]] for k, _ in sound],
                    data,
                    [slots[k] for k, _ in sound],
                    HEADER_BYTES,
                    [checksum for _, checksum in sound],
                )
            )
            for j, (k, _) in enumerate(sound):
                if j in mismatched:
                    self._log_unusable(job.hashes[indices[k]], data[slots[k], : lengths[k]])
                    unusable.append(k)
                else:
                    good.append(indices[k])

        self.pool.read_with(self._keys(job.hashes), use)
        if len(good) == len(job.block_ids):
            return LoadResult(job.req_id)
        kept = set(good)
        failed = [b for i, b in enumerate(job.block_ids) if i not in kept]
        kinds = {TransferFailure.CORRUPT} if unusable else set()
        if len(failed) > len(unusable):
            kinds.add(TransferFailure.MISSING)
        return LoadResult(job.req_id, failed_block_ids=failed, failure_kinds=kinds)

    def _log_unusable(self, block_hash: bytes, frame: Frames) -> None:
        error = self.codec.header_error(frame.data, block_hash)
        logger.warning("KV block %s is unusable (%s)", block_hash.hex(), error)

    def close(self) -> None:
        self.pool.close()


@dataclass(frozen=True)
class ShmOptions(StoreOptions):
    pool_name: str = option("tandem", "processes sharing blocks use the same name")
    capacity_bytes: int = option(DEFAULT_CAPACITY_BYTES, "bytes of the shared-memory pool")


class SharedMemoryConnector(StoreConnector):
    default_load_async = False
    options_class: ClassVar[type[StoreOptions]] = ShmOptions

    def make_store(self, context: ConnectorContext) -> BlockStore:
        options = ShmOptions.of(context.config)
        return ShmBlockStore(
            BlockCodec(context.model_name, context.layout),
            options.pool_name,
            options.capacity_bytes,
        )
