"""BlockPool: allocation, ref counts, eviction and the prefix-cache map."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from engine.kv_cache.block import FreeBlockQueue, KVCacheBlock
from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine.kv_cache.hashing import HASH_BYTES, BlockHash

if TYPE_CHECKING:
    from engine.request import Request

logger = logging.getLogger(__name__)

_GROUP_KEY_BYTES = 2


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of KV cache group ``group``: the same
    tokens in two groups are two blocks (different layers' KV). Group 0's
    key is the block hash itself, the one KV events and routers see."""
    return block_hash if group == 0 else block_hash + group.to_bytes(_GROUP_KEY_BYTES, "little")


def _is_group0_key(key: BlockHash) -> bool:
    return len(key) != HASH_BYTES + _GROUP_KEY_BYTES


class BlockHashToBlockMap:
    """hash -> cached block(s).

    Identical content can be cached in several blocks (blocks are never
    de-duplicated, so a request's block table only ever grows); the common
    case of one block per hash stores the block itself, not a dict.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHash) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: BlockHash, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: BlockHash, block_id: int) -> KVCacheBlock | None:
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
        return block

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._cache

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """Owns every KVCacheBlock.

    Block 0 is the null block: never handed out, never freed (as in vLLM, so
    free-block counts line up with it). Free blocks sit in ``free_queue`` in
    eviction order; a free block that still has a hash is a cached block
    and leaves the cache only when it is reallocated.
    Not thread-safe: the scheduler thread owns it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, enable_kv_events: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks = BlockHashToBlockMap()
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        self._events: list[KVCacheEvent] = []

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        return self.cached_blocks.get_one_block(group_key(block_hash, group))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group: int = 0,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] of ``request``
        (of KV cache group ``group``) under the request's block hashes. Null
        blocks (a windowed group's, past the window) are skipped; only group
        0's blocks make KV events."""
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id}: {num_full_blocks} full blocks to cache "
                f"but only {len(hashes)} block hashes"
            )
        insert = self.cached_blocks.insert
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            key = group_key(hashes[i], group)
            block.block_hash = key
            insert(key, block)
        if self.enable_kv_events and group == 0:
            lora = request.lora_request
            self._events.append(
                BlockStored(
                    block_hashes=hashes[num_cached_blocks:num_full_blocks],
                    parent_block_hash=hashes[num_cached_blocks - 1] if num_cached_blocks else None,
                    token_ids=request.all_token_ids[
                        num_cached_blocks * block_size : num_full_blocks * block_size
                    ],
                    block_size=block_size,
                    lora_id=lora.lora_int_id if lora is not None else None,
                    lora_name=lora.lora_name if lora is not None else None,
                )
            )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the front of the free queue, evicting any cached
        content they held. Raises ValueError if too few are free."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: {self.free_queue.num_free_blocks} free"
            )
        blocks = self.free_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt += 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        if self.cached_blocks.pop(block_hash, block.block_id) is None:
            return
        block.block_hash = None
        if self.enable_kv_events and _is_group0_key(block_hash):
            self._events.append(BlockRemoved(block_hashes=[block_hash]))

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free ones. The
        null block is nobody's: it takes no reference."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching zero join the
        free queue in the given order (first = evicted first)."""
        blocks = [b for b in ordered_blocks if not b.is_null]
        for block in blocks:
            block.ref_cnt -= 1
        self.free_queue.append_n([b for b in blocks if b.ref_cnt == 0])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refuses (returns False) while any
        block other than the null block is in use."""
        num_used = self.num_blocks - self.free_queue.num_free_blocks
        if num_used != 1:
            logger.warning("prefix cache not reset: %d blocks still in use", num_used - 1)
            return False
        self.cached_blocks = BlockHashToBlockMap()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) in use."""
        return 1.0 - self.free_queue.num_free_blocks / (self.num_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
