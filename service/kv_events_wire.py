"""vLLM's KV-event wire format, written with msgpack (no vLLM, no msgspec).

A consumer written for vLLM's ``--kv-events-config`` (publisher "zmq"), such
as llm-d's KV cache indexer or Dynamo's KV router, decodes these bytes
unchanged. vLLM encodes its msgspec structs ``array_like`` with a tagged
union, so on the wire every struct is a plain msgpack array:

    batch         [ts: float64, events: [event, ...], data_parallel_rank: int]
    BlockStored   ["BlockStored", block_hashes: [uint64], parent_block_hash:
                   uint64 | nil, token_ids: [int], block_size: int,
                   lora_id: int | nil, medium: str | nil]
    BlockRemoved  ["BlockRemoved", block_hashes: [uint64], medium: str | nil]
    AllBlocksCleared  ["AllBlocksCleared"]

Both msgspec and msgpack write each value in its smallest msgpack form, so
the bytes are the same as vLLM 0.12's. docs/kv-events.md ("KV events over
ZMQ (vLLM format)") documents each field.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine.kv_cache.hashing import BlockHash

MEDIUM_GPU = "GPU"
"""vLLM's name for the engine's own paged KV cache. Tandem sends it whatever
the device (CPU included): consumers read the medium as "which tier of this
pod holds the block", and this is the engine's own tier, the one a request
routed here hits without any transfer; offloaded tiers (CPU memory, Redis)
would carry other names."""

DATA_PARALLEL_RANK = 0
"""Tandem runs no data parallelism; vLLM's publisher fills in its rank, 0
for a single engine, so the batch always carries the third field."""

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay socket's last reply (its payload is empty)."""

_UINT64 = (1 << 64) - 1


def fold_block_hash(block_hash: BlockHash) -> int:
    """vLLM's default published value of a block hash (its
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest read as a
    big-endian integer, kept to its low 64 bits, i.e. the last 8 bytes."""
    return int.from_bytes(block_hash, "big") & _UINT64


def sequence_frame(sequence: int) -> bytes:
    """A batch's sequence number as sent: 8 bytes, big-endian, unsigned."""
    return sequence.to_bytes(8, "big")


def encode_batch(events: Sequence[KVCacheEvent], timestamp: float) -> bytes:
    """One step's events as one vLLM ``KVEventBatch`` payload."""
    batch = [float(timestamp), [_event(e) for e in events], DATA_PARALLEL_RANK]
    payload: bytes = msgpack.packb(batch, use_bin_type=True)
    return payload


def _event(event: KVCacheEvent) -> list[object]:
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return [
            "BlockStored",
            [fold_block_hash(h) for h in event.block_hashes],
            None if parent is None else fold_block_hash(parent),
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            MEDIUM_GPU,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [fold_block_hash(h) for h in event.block_hashes], MEDIUM_GPU]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV cache event: {event!r}")
