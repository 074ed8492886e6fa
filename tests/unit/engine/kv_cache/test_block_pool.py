"""BlockPool and its free queue: LRU order, ref counts, cache map, events."""

from __future__ import annotations

import pytest

from engine.kv_cache.block import FreeBlockQueue, KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.kv_cache.hashing import BlockHasher
from engine.request import Request
from engine.sampling_params import SamplingParams


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert q.popleft().block_id == 0
    q.remove(blocks[3])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5]
    assert ids(q.popleft_n(2)) == [1, 2]
    q.append(blocks[3])
    q.append_n([blocks[0], blocks[1]])
    assert ids(q.get_all_free_blocks()) == [4, 5, 3, 0, 1]
    assert q.num_free_blocks == 5
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[2])
    with pytest.raises(ValueError, match="only 5 left"):
        q.popleft_n(6)


def test_null_block_is_reserved():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="cannot allocate 1 blocks: 0 free"):
        pool.get_new_blocks(1)


def test_ref_counts_and_lru_free_order():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)
    pool.touch(a[:1])
    assert [b.ref_cnt for b in a] == [2, 1, 1]
    pool.free_blocks(reversed(a))
    assert [b.ref_cnt for b in a] == [1, 0, 0]
    # Free blocks join at the tail, in the order given (tail of a first).
    assert ids(pool.free_queue.get_all_free_blocks()) == [4, 5, 3, 2]
    assert pool.get_usage() == pytest.approx(1 / 5)


def _request(tokens: list[int], hasher: BlockHasher) -> Request:
    return Request("r", tokens, SamplingParams(), block_hasher=hasher)


def test_cached_blocks_are_found_until_evicted_and_events_report_it():
    pool = BlockPool(4, enable_caching=True, enable_kv_events=True)
    hasher = BlockHasher(16)
    req = _request(list(range(40)), hasher)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, 16)
    stored = pool.take_events()
    assert stored == [BlockStored(req.block_hashes[:2], None, list(range(32)), 16)]
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    pool.free_blocks(reversed(blocks))  # free queue: 3, 2, 1
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]  # still cached
    pool.get_new_blocks(2)  # evicts block 2 (hash 1); block 3 had none
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.take_events() == [BlockRemoved([req.block_hashes[1]])]
    assert pool.reset_prefix_cache() is False  # blocks 2 and 3 in use


def test_duplicate_content_in_two_blocks_is_tracked_per_block():
    pool = BlockPool(4, enable_caching=True)
    hasher = BlockHasher(16)
    r1, r2 = _request(list(range(16)), hasher), _request(list(range(16)), hasher)
    b1, b2 = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(r1, b1, 0, 1, 16)
    pool.cache_full_blocks(r2, b2, 0, 1, 16)
    assert pool.get_cached_block(r1.block_hashes[0]) is b1[0]
    pool.free_blocks(b1)
    pool.get_new_blocks(2)  # evicts b1's copy (free order: 3, then 1)
    assert pool.get_cached_block(r1.block_hashes[0]) is b2[0]


def test_reset_prefix_cache_clears_hashes_when_idle():
    pool = BlockPool(4, enable_caching=True, enable_kv_events=True)
    req = _request(list(range(16)), BlockHasher(16))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, blocks, 0, 1, 16)
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert blocks[0].block_hash is None and len(pool.cached_blocks) == 0
    assert pool.take_events() == [AllBlocksCleared()]
