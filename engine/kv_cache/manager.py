"""KVCacheManager: the scheduler's view of the paged KV cache.

It maps requests to blocks, finds prefix-cache hits and caches full blocks.
One KV cache group (every layer uses full attention with the same block
table), so block ids are plain ``list[int]`` where vLLM has a tuple per group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import KVCacheEvent
from engine.kv_cache.stats import PrefixCacheStats

if TYPE_CHECKING:
    from engine.request import Request


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Blocks handed between the manager and the scheduler (read-only)."""

    blocks: Sequence[KVCacheBlock]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks([*self.blocks, *other.blocks])

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> list[int]: ...

    @overload
    def get_block_ids(self, allow_none: bool) -> list[int] | None: ...

    def get_block_ids(self, allow_none: bool = False) -> list[int] | None:
        """Block ids in order; with ``allow_none``, None when empty."""
        if allow_none and not self.blocks:
            return None
        return [b.block_id for b in self.blocks]

    def get_unhashed_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks if b.block_hash is None]

    def __len__(self) -> int:
        return len(self.blocks)


class KVCacheManager:
    """Allocates and frees a request's blocks and serves prefix-cache hits.

    Methods mutate pool state and are called from the scheduler thread only.
    ``allocate_slots`` returns None (and changes nothing) when the pool is
    too small; every other failure is a bug and raises.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
        log_stats: bool = True,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_events)
        # A defaultdict, as in vLLM: probing a request registers it, which
        # get_num_common_prefix_blocks counts.
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.empty_kv_cache_blocks = KVCacheBlocks(())

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest run of cached full blocks matching the request's prefix.

        Never covers the last token: a full hit still computes one token so
        the model produces logits. Does not take references (see
        allocate_slots). Returns (blocks, number of hit tokens).
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.cached_blocks.get_one_block
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if self.log_stats:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hit_tokens, request.num_preemptions > 0
            )
        return (KVCacheBlocks(hits) if hits else self.empty_kv_cache_blocks), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``num_new_tokens`` includes externally loaded tokens but not the
        ``num_new_computed_tokens`` local prefix hits in
        ``new_computed_blocks``. Returns the newly allocated blocks, or None
        if the pool cannot supply them (then nothing changed). Unless
        ``delay_cache_blocks`` (KV still arriving from a connector), full
        blocks are registered in the prefix cache.
        """
        # This runs for every scheduled request every step: the common decode
        # (no prefix hit, no new block, no block filled) touches no method.
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        request_id = request.request_id
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        end = num_computed_tokens + num_new_tokens
        num_tokens_need_slot = end + num_lookahead_tokens
        if num_tokens_need_slot > self.max_model_len:
            num_tokens_need_slot = self.max_model_len
        block_size = self.block_size
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = (num_tokens_need_slot + block_size - 1) // block_size - len(req_blocks)
        pool = self.block_pool
        computed = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        if computed:
            # Reviving a free cached block takes it out of the free pool too.
            num_new_blocks -= len(computed)
            num_evictable = sum(1 for b in computed if b.ref_cnt == 0 and not b.is_null)
            if num_new_blocks + num_evictable > pool.free_queue.num_free_blocks:
                return None
            if req_blocks or request_id in self.num_cached_block:
                raise RuntimeError(f"request {request_id} got a prefix hit while holding blocks")
            pool.touch(computed)
            req_blocks.extend(computed)
            self.num_cached_block[request_id] = len(computed)
        elif num_new_blocks > pool.free_queue.num_free_blocks:
            return None
        if self.enable_caching and not delay_cache_blocks:
            # Cache only final tokens: drafts may still be rejected.
            num_tokens = len(request.all_token_ids)
            num_full = (end if end < num_tokens else num_tokens) // block_size
            if num_new_blocks > 0:
                new_blocks = pool.get_new_blocks(num_new_blocks)
                req_blocks.extend(new_blocks)
                self._cache_full(request, req_blocks, num_full)
                return KVCacheBlocks(new_blocks)
            if num_full > self.num_cached_block.get(request_id, 0):
                self._cache_full(request, req_blocks, num_full)
        elif num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            return KVCacheBlocks(new_blocks)
        return self.empty_kv_cache_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that ``num_computed_tokens`` fills."""
        if not self.enable_caching:
            return
        self._cache_full(
            request, self.req_to_blocks[request.request_id], num_computed_tokens // self.block_size
        )

    def _cache_full(self, request: Request, blocks: list[KVCacheBlock], num_full: int) -> None:
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full, self.block_size)
        self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that the tail of a
        sequence is evicted before its (more shareable) head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        blocks = self.req_to_blocks[request_id]
        return KVCacheBlocks(blocks) if blocks else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks[request_id]]

    def num_blocks(self, request_id: str) -> int:
        """How many blocks the request holds. Unlike get_blocks, asking
        does not register the request (see get_num_common_prefix_blocks)."""
        blocks = self.req_to_blocks.get(request_id)
        return len(blocks) if blocks else 0

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks of the request shared by every request that holds
        blocks (a hint for cascade attention)."""
        if not self.enable_caching:
            return 0  # as vLLM: only prefix-cached blocks can be common
        num_holders = len(self.req_to_blocks)
        count = 0
        for block in self.req_to_blocks[running_request_id]:
            if block.ref_cnt != num_holders:
                break
            count += 1
        return count

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the stats gathered since the last call and start afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()
