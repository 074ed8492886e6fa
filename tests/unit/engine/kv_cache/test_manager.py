"""KVCacheManager: prefix hits, slot allocation, caching and freeing."""

from __future__ import annotations

import pytest

from engine.kv_cache.hashing import BlockHasher
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 16


def manager(num_blocks: int = 11, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_model_len=1024, enable_caching=caching)


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), block_hasher=BlockHasher(BS))


def test_allocate_caches_full_blocks_and_a_second_request_hits_them():
    kvm = manager()
    r0 = request("r0", list(range(40)))
    assert kvm.get_computed_blocks(r0) == (kvm.empty_kv_cache_blocks, 0)
    new = kvm.allocate_slots(r0, 40)
    assert new is not None and new.get_block_ids() == ([1, 2, 3],)
    assert kvm.num_cached_block["r0"] == 2
    r1 = request("r1", [*range(32), 99, 98])
    hits, n = kvm.get_computed_blocks(r1)
    assert (hits.get_block_ids(), n) == (([1, 2],), 32)
    new1 = kvm.allocate_slots(r1, 2, n, hits)
    assert new1 is not None and new1.get_block_ids() == ([4],)
    assert kvm.get_block_ids("r1") == ([1, 2, 4],)
    assert kvm.get_num_common_prefix_blocks("r0") == 2
    stats = kvm.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 74, 32)


def test_hit_never_covers_the_last_token():
    kvm = manager()
    r0 = request("r0", list(range(32)))
    kvm.allocate_slots(r0, 32)
    _, n = kvm.get_computed_blocks(request("r1", list(range(32))))
    assert n == 16  # the whole last block is recomputed, not served
    _, n = kvm.get_computed_blocks(request("r2", list(range(33))))
    assert n == 32


def test_allocation_fails_cleanly_when_the_pool_is_short():
    kvm = manager(num_blocks=4)  # 3 usable
    r0 = request("r0", list(range(40)))
    assert kvm.allocate_slots(r0, 64) is None
    assert kvm.get_num_free_blocks() == 3 and kvm.get_block_ids("r0") == ([],)
    assert kvm.allocate_slots(r0, 40) is not None
    assert kvm.usage == pytest.approx(1.0)


def test_reviving_a_free_cached_block_counts_against_the_pool():
    kvm = manager(num_blocks=4)
    r0 = request("r0", list(range(33)))
    kvm.allocate_slots(r0, 33)
    kvm.free(r0)
    r1 = request("r1", list(range(33)))
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 32
    # 2 revived + 1 new = 3 blocks: exactly the pool.
    assert kvm.allocate_slots(r1, 1, n, hits) is not None
    assert kvm.get_num_free_blocks() == 0


def test_free_releases_tail_first_and_decode_reuses_blocks():
    kvm = manager()
    r0 = request("r0", list(range(20)))
    kvm.allocate_slots(r0, 20)
    r0.num_computed_tokens = 20
    r0.append_output_token_id(5)
    assert kvm.allocate_slots(r0, 1) is kvm.empty_kv_cache_blocks  # fits block 2
    kvm.free(r0)
    free = kvm.block_pool.free_queue.get_all_free_blocks()
    assert [b.block_id for b in free][-2:] == [2, 1]


def test_lookahead_and_max_model_len_bound_the_slots():
    kvm = KVCacheManager(20, BS, max_model_len=40)
    r0 = request("r0", list(range(10)))
    new = kvm.allocate_slots(r0, 10, num_lookahead_tokens=100)
    assert new is not None and len(new) == 3  # capped at 40 tokens


def test_no_caching_means_no_hits():
    kvm = manager(caching=False)
    r0 = request("r0", list(range(40)))
    kvm.allocate_slots(r0, 40)
    assert kvm.get_computed_blocks(request("r1", list(range(40))))[1] == 0
    assert len(kvm.block_pool.cached_blocks) == 0


def test_zero_tokens_is_an_error():
    with pytest.raises(ValueError, match="num_new_tokens must be > 0"):
        manager().allocate_slots(request("r0", [1]), 0)


def test_num_blocks_counts_a_requests_blocks_without_registering_it():
    kvm = manager()
    r0 = request("r0", list(range(40)))
    assert kvm.num_blocks("r0") == 0
    assert "r0" not in kvm.req_to_blocks  # asking did not register it
    kvm.allocate_slots(r0, 40)
    assert kvm.num_blocks("r0") == 3
    kvm.free(r0)
    assert kvm.num_blocks("r0") == 0
