"""SharedMemoryConnector: KV blocks in a POSIX shared-memory pool on one host.

For prefill and decode processes on the same machine, and as a CPU tier
under the GPU cache (``--kv-offload shm``). Blocks live in a fixed-size
``ShmBlockPool`` (``connectors.shm_pool``) with LRU eviction, shared by
every process that opens the same pool name; the last process to close it
removes the segments.

Lookups are local memory operations, so the scheduler asks the pool
directly; hits load synchronously before the forward by default (a memory
copy), and P/D consumers load asynchronously like any other connector.

Extra config (``kv_connector_extra_config``):

* ``pool_name``: processes sharing blocks use the same name (default
  ``"tandem"``; the model's namespace is appended, so models never mix).
* ``capacity_bytes``: pool size (default 1 GiB); the pool holds
  ``capacity_bytes // frame size`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from connectors.base import ConnectorContext
from connectors.block_codec import BlockCodec
from connectors.kv_blocks import Frames
from connectors.shm_pool import ShmBlockPool, ShmPoolConfig
from connectors.store import BlockStore
from connectors.store_connector import StoreConnector

DEFAULT_CAPACITY_BYTES = 1 << 30


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
            ShmPoolConfig(f"{pool_name}-{codec.namespace}", num_slots, codec.frame_bytes)
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

    def close(self) -> None:
        self.pool.close()


class SharedMemoryConnector(StoreConnector):
    default_load_async = False

    def make_store(self, context: ConnectorContext) -> BlockStore:
        extra = context.config.kv_connector_extra_config
        return ShmBlockStore(
            BlockCodec(context.model_name, context.layout),
            str(extra.get("pool_name", "tandem")),
            int(extra.get("capacity_bytes", DEFAULT_CAPACITY_BYTES)),
        )
