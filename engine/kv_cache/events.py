"""KV cache events for prefix-aware routing.

The block pool records these when events are enabled; the engine drains them
each step and the service streams them to subscribers (SubscribeKvEvents).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached. ``token_ids`` covers every stored block in
    order; ``parent_block_hash`` is None when the first one starts a sequence."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    # The LoRA adapter the blocks were computed under (None: the base
    # model); its cache key is in the hashes already, these name it.
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted and can no longer be hit."""

    block_hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
