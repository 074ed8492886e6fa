"""The shared-memory store's zero-copy paths: blocks go from the paged cache
straight into pool slots (sealed there) and back, verified in place."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from connectors.block_codec import HEADER_BYTES, BlockCodec
from connectors.kv_blocks import KVBlockIO
from connectors.shm_connector import ShmBlockStore
from connectors.store import LoadJob, direct_store, load_blocks, load_into_cache
from engine.kv_transfer.base import KVLayout
from engine.stats import TransferFailure

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")


def _caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 12, 16, 2, 16, generator=gen) for _ in range(LAYOUT.num_layers)]


@pytest.fixture
def store() -> Iterator[ShmBlockStore]:
    codec = BlockCodec("test-model", LAYOUT)
    shm = ShmBlockStore(codec, f"direct-{uuid.uuid4().hex[:8]}", 8 * codec.frame_bytes)
    yield shm
    shm.close()


def _io(caches: list[torch.Tensor]) -> KVBlockIO:
    io = KVBlockIO(caches)
    if not io.copies_rows:
        pytest.skip("no C++ toolchain: the shared-memory store copies through frames")
    return io


def test_direct_save_then_load_round_trips(store: ShmBlockStore) -> None:
    src, dst = _caches(0), [torch.zeros(2, 12, 16, 2, 16) for _ in range(LAYOUT.num_layers)]
    src_io, dst_io = _io(src), _io(dst)
    assert direct_store(store, src_io) is store
    hashes = [uuid.uuid4().bytes * 2 for _ in range(3)]
    store.save_direct(src_io, hashes, [4, 1, 9])
    # What the pool holds is a normal frame: the generic path reads it too.
    frames_result = load_blocks(store, store.codec, LoadJob("r", hashes, [2, 3, 5]))
    assert frames_result.failed_block_ids == []
    result = load_into_cache(store, store.codec, dst_io, LoadJob("r", hashes, [2, 3, 5]))
    assert result.failed_block_ids == []
    for s, d in zip(src, dst, strict=True):
        torch.testing.assert_close(d[:, [2, 3, 5]], s[:, [4, 1, 9]], rtol=0, atol=0)
        assert not d[:, [0, 1, 4, 6, 7, 8, 9, 10, 11]].any()


def test_direct_load_reports_absent_and_corrupt_blocks(store: ShmBlockStore) -> None:
    src_io = _io(_caches(1))
    dst = [torch.zeros(2, 12, 16, 2, 16) for _ in range(LAYOUT.num_layers)]
    hashes = [uuid.uuid4().bytes * 2 for _ in range(3)]
    store.save_direct(src_io, hashes[:2], [1, 2])

    def corrupt(data, indices, slots, lengths):
        data[slots[0], HEADER_BYTES + 5] ^= 0xFF

    store.pool.read_with([store.codec.digest_key(hashes[1])], corrupt)
    result = store.load_direct(_io(dst), LoadJob("r", hashes, [6, 7, 8]))
    assert sorted(result.failed_block_ids) == [7, 8]  # corrupt, absent
    assert dst[0][:, 6].any() and not dst[0][:, [7, 8]].any()
    assert result.failure_kinds == {TransferFailure.CORRUPT, TransferFailure.MISSING}
    only_absent = store.load_direct(_io(dst), LoadJob("r", hashes[2:], [9]))
    assert only_absent.failure_kinds == {TransferFailure.MISSING}


def test_direct_save_skips_blocks_already_stored(store: ShmBlockStore) -> None:
    io = _io(_caches(2))
    block_hash = uuid.uuid4().bytes * 2
    store.save_direct(io, [block_hash], [3])
    before = store.pool.stats()
    store.save_direct(io, [block_hash, block_hash], [3, 3])
    assert store.pool.stats().used_slots == before.used_slots == 1
