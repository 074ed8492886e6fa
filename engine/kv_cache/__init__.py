"""Paged KV cache bookkeeping: blocks, prefix hashing, the manager. No torch."""

from engine.kv_cache.block import FreeBlockQueue, KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine.kv_cache.hashing import (
    NONE_HASH,
    BlockHash,
    BlockHasher,
    hash_block_tokens,
    hash_chain,
)
from engine.kv_cache.manager import KVCacheBlocks, KVCacheManager

__all__ = [
    "NONE_HASH",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheEvent",
    "KVCacheManager",
    "hash_block_tokens",
    "hash_chain",
]
