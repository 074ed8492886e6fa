"""KVCacheManager with a sliding-window group: blocks that leave the window
go back to the pool, prefix hits hold what every layer will read."""

from __future__ import annotations

import random

from engine.kv_cache.block_pool import group_key
from engine.kv_cache.events import BlockStored
from engine.kv_cache.hashing import BlockHasher
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 16
WINDOW = 32  # a token attends to itself and the 31 before it: 2 blocks back
GROUPS = (None, WINDOW)  # one full-attention group, one windowed


def manager(num_blocks: int = 40, rollback: int = 0, events: bool = False) -> KVCacheManager:
    return KVCacheManager(
        num_blocks,
        BS,
        max_model_len=1024,
        group_windows=GROUPS,
        max_rollback=rollback,
        enable_kv_events=events,
    )


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), block_hasher=BlockHasher(BS))


def prefill(kvm: KVCacheManager, req: Request, chunk: int = BS) -> list[int]:
    """Schedule the prompt chunk by chunk, as the scheduler would; returns
    every block id handed out, in order."""
    given: list[int] = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        new = kvm.allocate_slots(req, n)
        assert new is not None
        given += [b for group in new.get_block_ids() for b in group]
        req.num_computed_tokens += n
    return given


def real(blocks: list[int]) -> list[int]:
    return [b for b in blocks if b != 0]


def test_blocks_leave_the_windowed_group_and_are_reused():
    # 12 usable blocks; 128 tokens take 8 per group: 16 if none were freed.
    kvm = manager(num_blocks=13)
    r0 = request("r0", list(range(128)))
    given = prefill(kvm, r0)
    full, windowed = kvm.get_block_ids("r0")
    assert len(full) == len(windowed) == 8
    # The last chunk started at token 112: tokens from 81 on can still be
    # read, so blocks 0..4 (tokens 0..79) went back to the pool.
    assert windowed[:5] == [0] * 5 and 0 not in windowed[5:]
    assert kvm.num_held_blocks("r0") == 8 + 3
    assert kvm.get_num_free_blocks() == 12 - 11
    assert len(given) == 16 and len(set(given)) == 12  # freed blocks came back
    kvm.free(r0)
    assert kvm.get_num_free_blocks() == 12


def test_decode_frees_a_block_each_time_the_window_moves_past_one():
    kvm = manager()
    r0 = request("r0", list(range(40)))
    prefill(kvm, r0, chunk=40)
    held = [kvm.num_held_blocks("r0")]
    for token in range(60):
        r0.append_output_token_id(token)
        assert kvm.allocate_slots(r0, 1) is not None
        r0.num_computed_tokens += 1
        held.append(kvm.num_held_blocks("r0"))
    full, windowed = kvm.get_block_ids("r0")
    assert len(full) == 7  # 100 tokens
    # The windowed group never holds more than its window's 3 blocks.
    assert len(real(windowed)) == 3
    assert held[-1] == 7 + 3


def test_a_rollback_margin_keeps_more_blocks_behind_the_window():
    plain, margin = manager(), manager(rollback=BS)
    for kvm in (plain, margin):
        prefill(kvm, request("r0", list(range(128))))
    assert plain.num_held_blocks("r0") == 8 + 3
    assert margin.num_held_blocks("r0") == 8 + 4


def test_prefix_hit_holds_the_full_group_and_the_window_before_its_end():
    kvm = manager()
    r0 = request("r0", list(range(128)))
    prefill(kvm, r0)
    full0, windowed0 = kvm.get_block_ids("r0")
    kvm.free(r0)
    r1 = request("r1", [*range(128), 7, 7, 7])
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 128
    full, windowed = hits.get_block_ids()
    assert full == full0
    # From token 128 on, tokens 97..127 are read: blocks 6 and 7.
    assert windowed == [0] * 6 + windowed0[6:]
    assert kvm.allocate_slots(r1, 3, n, hits) is not None
    assert kvm.num_held_blocks("r1") == 9 + 3


def _oracle_hit(kvm: KVCacheManager, req: Request) -> int:
    """The longest prefix (in blocks) with every full-group block and the
    windowed group's last 2 blocks before its end cached, by brute force."""
    hashes = req.block_hashes[: (req.num_tokens - 1) // BS]

    def cached(i: int, group: int) -> bool:
        return kvm.block_pool.cached_blocks.get_one_block(group_key(hashes[i], group)) is not None

    for n in range(len(hashes), 0, -1):
        full_ok = all(cached(i, 0) for i in range(n))
        window_ok = all(cached(i, 1) for i in range(max(0, n - 2), n))
        if full_ok and window_ok:
            return n
    return 0


def test_prefix_hits_after_random_evictions_match_a_brute_force_oracle():
    rng = random.Random(0)
    for trial in range(30):
        kvm = manager(num_blocks=40)
        r0 = request("r0", list(range(160)))
        prefill(kvm, r0)
        kvm.free(r0)
        # Evict a random number of the pool's free blocks (front first).
        kvm.block_pool.get_new_blocks(rng.randrange(0, 30))
        r1 = request("r1", [*range(160), 5])
        hits, n = kvm.get_computed_blocks(r1)
        assert n == _oracle_hit(kvm, r1) * BS, f"trial {trial}"
        if n:
            full, windowed = hits.get_block_ids()
            assert 0 not in full and len(full) == len(windowed) == n // BS
            assert 0 not in windowed[-2:]


def test_kv_events_report_only_the_first_groups_blocks():
    kvm = manager(events=True)
    prefill(kvm, request("r0", list(range(64))))
    stored = [e for e in kvm.take_events() if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == 4 and all(len(h) == 32 for h in hashes)
