"""KVCacheManager: the scheduler's view of the paged KV cache.

It maps requests to blocks, finds prefix-cache hits and caches full blocks.
A request holds one block list per KV cache group (``engine.kv_cache.groups``),
all of the same length: entry ``i`` covers tokens ``i * block_size`` onward.
A windowed group's entries left of its window are the null block: their
blocks went back to the pool (still cached for prefix hits) once no token to
come can attend to them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_pool import BlockPool, group_key
from engine.kv_cache.events import KVCacheEvent
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.stats import PrefixCacheStats

if TYPE_CHECKING:
    from engine.request import Request

BlockIds = tuple[list[int], ...]
"""A request's block ids, one list per KV cache group."""


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Blocks handed between the manager and the scheduler (read-only), one
    sequence per KV cache group."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        pairs = zip(self.blocks, other.blocks, strict=True)
        return KVCacheBlocks(tuple([*a, *b] for a, b in pairs))

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> BlockIds: ...

    @overload
    def get_block_ids(self, allow_none: bool) -> BlockIds | None: ...

    def get_block_ids(self, allow_none: bool = False) -> BlockIds | None:
        """Block ids in order, per group; with ``allow_none``, None when empty."""
        if allow_none and not self.blocks[0]:
            return None
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __len__(self) -> int:
        """Blocks per group."""
        return len(self.blocks[0])


class KVCacheManager:
    """Allocates and frees a request's blocks and serves prefix-cache hits.

    Methods mutate pool state and are called from the scheduler thread only.
    ``allocate_slots`` returns None (and allocates nothing) when the pool is
    too small; every other failure is a bug and raises.

    ``group_windows``: per KV cache group, its layers' sliding window (None:
    full attention). ``max_rollback``: how many computed tokens a step may
    take back (rejected drafts); a windowed group keeps that many more
    tokens' blocks behind its window.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
        log_stats: bool = True,
        group_windows: Sequence[int | None] = (None,),
        max_rollback: int = 0,
    ) -> None:
        if not group_windows:
            raise ValueError("group_windows must name at least one KV cache group")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_events)
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        # (group, tokens behind a position it keeps) for each windowed group.
        self._windowed = [
            (g, w - 1 + max_rollback) for g, w in enumerate(self.group_windows) if w is not None
        ]
        # A defaultdict, as in vLLM: probing a request registers it, which
        # get_num_common_prefix_blocks counts.
        self.req_to_blocks: defaultdict[str, tuple[list[KVCacheBlock], ...]] = defaultdict(
            self._no_blocks
        )
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.empty_kv_cache_blocks = KVCacheBlocks(((),) * self.num_groups)

    def _no_blocks(self) -> tuple[list[KVCacheBlock], ...]:
        return tuple([] for _ in range(self.num_groups))

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request, as blocks per group.

        Never covers the last token: a full hit still computes one token so
        the model produces logits. A full-attention group needs every block
        of the prefix cached, a windowed group only those its window reaches
        from the prefix's end (the rest are the null block). Does not take
        references (see allocate_slots). Returns (blocks, hit tokens).
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        num_hit = self._full_hit(hashes)
        if self._windowed:
            num_hit = self._windowed_hit(hashes, num_hit)
        num_hit_tokens = num_hit * self.block_size
        if self.log_stats:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hit_tokens, request.num_preemptions > 0
            )
        if not num_hit:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks(self._hit_blocks(hashes, num_hit)), num_hit_tokens

    def _full_hit(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks cached in every full-attention group."""
        get = self.block_pool.cached_blocks.get_one_block
        num_hit = len(hashes)
        for g, window in enumerate(self.group_windows):
            if window is not None:
                continue
            for i in range(num_hit):
                if get(group_key(hashes[i], g)) is None:
                    num_hit = i
                    break
        return num_hit

    def _windowed_hit(self, hashes: Sequence[BlockHash], num_hit: int) -> int:
        """The longest prefix of at most ``num_hit`` blocks whose end every
        windowed group's cached blocks cover back to its window's start.
        Shortening the prefix for one group can break another's cover, so
        this repeats until no group shortens it."""
        changed = True
        while changed and num_hit:
            changed = False
            for g, _ in self._windowed:
                n = self._window_cover(hashes, num_hit, g)
                if n < num_hit:
                    num_hit, changed = n, True
        return num_hit

    def _window_cover(self, hashes: Sequence[BlockHash], limit: int, group: int) -> int:
        """The largest n <= limit with group ``group``'s blocks [n - k, n)
        all cached, k being the blocks its window reaches back (or all
        blocks before n, when n < k)."""
        window = self.group_windows[group]
        assert window is not None
        need = -(-(window - 1) // self.block_size)
        if need == 0:
            return limit
        get = self.block_pool.cached_blocks.get_one_block
        run = 0
        for i in range(limit - 1, -1, -1):
            if get(group_key(hashes[i], group)) is None:
                run = 0
                continue
            run += 1
            if run >= need:
                return i + run
        return run  # the run reaching block 0, if any

    def _hit_blocks(
        self, hashes: Sequence[BlockHash], num_hit: int
    ) -> tuple[list[KVCacheBlock], ...]:
        get = self.block_pool.cached_blocks.get_one_block
        null = self.block_pool.null_block
        out: list[list[KVCacheBlock]] = []
        for g, window in enumerate(self.group_windows):
            first = 0 if window is None else max(0, (num_hit * self.block_size - window + 1))
            first //= self.block_size
            blocks = [null] * first
            for i in range(first, num_hit):
                block = get(group_key(hashes[i], g))
                assert block is not None  # checked by _full_hit / _window_cover
                blocks.append(block)
            out.append(blocks)
        return tuple(out)

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
        if the pool cannot supply them (then nothing was allocated, though
        blocks that left a window may have been freed). Unless
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
        if self._windowed and req_blocks[0]:
            self._free_behind_windows(req_blocks, num_computed_tokens)
        num_new_blocks = (num_tokens_need_slot + block_size - 1) // block_size - len(req_blocks[0])
        pool = self.block_pool
        computed = new_computed_blocks.blocks if new_computed_blocks is not None else None
        if computed is not None and computed[0]:
            # Reviving a free cached block takes it out of the free pool too.
            num_new_blocks -= len(computed[0])
            num_evictable = sum(
                1 for group in computed for b in group if b.ref_cnt == 0 and not b.is_null
            )
            if num_new_blocks * self.num_groups + num_evictable > pool.free_queue.num_free_blocks:
                return None
            if req_blocks[0] or request_id in self.num_cached_block:
                raise RuntimeError(f"request {request_id} got a prefix hit while holding blocks")
            for held, hit in zip(req_blocks, computed, strict=True):
                pool.touch(hit)
                held.extend(hit)
            self.num_cached_block[request_id] = len(computed[0])
        elif num_new_blocks * self.num_groups > pool.free_queue.num_free_blocks:
            return None
        new_blocks = (
            self._extend(req_blocks, num_new_blocks)
            if num_new_blocks > 0
            else self.empty_kv_cache_blocks
        )
        if self.enable_caching and not delay_cache_blocks:
            # Cache only final tokens: drafts may still be rejected.
            num_tokens = len(request.all_token_ids)
            num_full = (end if end < num_tokens else num_tokens) // block_size
            if num_full > self.num_cached_block.get(request_id, 0):
                self._cache_full(request, req_blocks, num_full)
        return new_blocks

    def _extend(
        self, req_blocks: tuple[list[KVCacheBlock], ...], num_new_blocks: int
    ) -> KVCacheBlocks:
        new = []
        for held in req_blocks:
            blocks = self.block_pool.get_new_blocks(num_new_blocks)
            held.extend(blocks)
            new.append(blocks)
        return KVCacheBlocks(tuple(new))

    def _free_behind_windows(
        self, req_blocks: tuple[list[KVCacheBlock], ...], num_computed_tokens: int
    ) -> None:
        """Free each windowed group's blocks that no token from
        ``num_computed_tokens`` on can attend to, leaving the null block."""
        null = self.block_pool.null_block
        for g, keep in self._windowed:
            blocks = req_blocks[g]
            stop = min((num_computed_tokens - keep) // self.block_size, len(blocks))
            freed = []
            for i in range(stop - 1, -1, -1):
                if blocks[i].is_null:
                    break  # freed by an earlier step, with everything before it
                freed.append(blocks[i])
                blocks[i] = null
            if freed:
                self.block_pool.free_blocks(freed)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that ``num_computed_tokens`` fills."""
        if not self.enable_caching:
            return
        self._cache_full(
            request, self.req_to_blocks[request.request_id], num_computed_tokens // self.block_size
        )

    def _cache_full(
        self, request: Request, blocks: tuple[list[KVCacheBlock], ...], num_full: int
    ) -> None:
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_cached >= num_full:
            return
        for g, group_blocks in enumerate(blocks):
            self.block_pool.cache_full_blocks(
                request, group_blocks, num_cached, num_full, self.block_size, g
            )
        self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that the tail of a
        sequence is evicted before its (more shareable) head."""
        groups = self.req_to_blocks.pop(request.request_id, None)
        for blocks in groups or ():
            self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        blocks = self.req_to_blocks[request_id]
        return KVCacheBlocks(blocks) if blocks[0] else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> BlockIds:
        return tuple([b.block_id for b in group] for group in self.req_to_blocks[request_id])

    def num_blocks(self, request_id: str) -> int:
        """How many blocks (per group) the request holds. Unlike get_blocks,
        asking does not register the request (see get_num_common_prefix_blocks)."""
        blocks = self.req_to_blocks.get(request_id)
        return len(blocks[0]) if blocks else 0

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds over every group, null blocks not counted."""
        groups = self.req_to_blocks.get(request_id, ())
        return sum(1 for blocks in groups for b in blocks if not b.is_null)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks of group 0 shared by every request that holds
        blocks (a hint for cascade attention)."""
        if not self.enable_caching:
            return 0  # as vLLM: only prefix-cached blocks can be common
        num_holders = len(self.req_to_blocks)
        count = 0
        for block in self.req_to_blocks[running_request_id][0]:
            if block.is_null or block.ref_cnt != num_holders:
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
