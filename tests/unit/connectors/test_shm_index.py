"""The shared-memory pool's slot index: compiled ShmIndex against NumpyIndex."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from connectors.shm_index import KEY_BYTES, NumpyIndex, make_index
from connectors.shm_pool import ShmBlockPool, ShmPoolConfig, _header_dtype, cleanup_stale
from kernels import cpu_kernels

pytestmark = pytest.mark.skipif(
    not Path("/dev/shm").is_dir(), reason="needs POSIX shared memory in /dev/shm"
)


@pytest.fixture(scope="module")
def module() -> ModuleType:
    built = cpu_kernels.load()
    if built is None:
        pytest.skip("the compiled CPU kernels are not available")
    return built


@pytest.fixture
def names() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:
        cleanup_stale(name)


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"key-{i}".encode()).digest()


def blob_of(i: int, slot_bytes: int) -> bytes:
    size = 1 + (i * 7919) % slot_bytes
    return bytes([i % 251]) * size


def new_pool(names: list[str], compiled: ModuleType | None, slots: int = 6) -> ShmBlockPool:
    name = f"test-{uuid.uuid4().hex[:12]}"
    names.append(name)
    return ShmBlockPool(ShmPoolConfig(name, num_slots=slots, slot_bytes=256), compiled)


def test_compiled_and_numpy_pools_behave_alike(module: ModuleType, names: list[str]) -> None:
    """A random run of puts, zero-copy writes, reads and lookups, with
    repeated keys and more keys than slots, gives the same answers and the
    same evictions on both indexes."""
    pools = [new_pool(names, None), new_pool(names, module)]
    rng = np.random.default_rng(7)
    try:
        for _ in range(300):
            ids = rng.integers(0, 14, size=int(rng.integers(1, 9))).tolist()
            keys = [key_of(i) for i in ids]
            op = int(rng.integers(0, 4))
            answers: list[object]
            if op == 0:
                items = [(key_of(i), blob_of(i, 256)) for i in ids]
                answers = [pool.put_many(items) for pool in pools]
            elif op == 1:
                answers = [_write_with(pool, ids) for pool in pools]
            elif op == 2:
                answers = [pool.get_many(keys) for pool in pools]
            else:
                answers = [pool.contains_many(keys) for pool in pools]
            assert answers[0] == answers[1], f"op {op} on {ids}"
            assert pools[0].stats() == pools[1].stats()
        assert pools[0].stats().evictions > 0
    finally:
        for pool in pools:
            pool.close()


def _write_with(pool: ShmBlockPool, ids: list[int]) -> tuple[int, list[int]]:
    """write_with of ids' blobs, filled through the given rows; returns the
    count written and the positions fill was asked for."""
    asked: list[int] = []

    def fill(data: np.ndarray, indices: list[int], slots: list[int]) -> None:
        asked.extend(indices)
        for i, slot in zip(indices, slots, strict=True):
            data[slot, :] = ids[i] % 251

    return pool.write_with([key_of(i) for i in ids], 256, fill), asked


def test_write_with_fills_first_occurrences_only(module: ModuleType, names: list[str]) -> None:
    with new_pool(names, module) as pool:
        assert _write_with(pool, [3, 4, 3, 5]) == (3, [0, 1, 3])
        assert _write_with(pool, [4, 6]) == (1, [1])
        assert pool.get_many([key_of(3), key_of(6)]) == [bytes([3]) * 256, bytes([6]) * 256]


def test_compiled_and_numpy_attachments_share_one_pool(
    module: ModuleType, names: list[str]
) -> None:
    name = f"test-{uuid.uuid4().hex[:12]}"
    names.append(name)
    config = ShmPoolConfig(name, num_slots=3, slot_bytes=64)
    with ShmBlockPool(config, module) as fast, ShmBlockPool(config, None) as plain:
        fast.put_many([(key_of(i), bytes([i])) for i in range(3)])
        assert plain.get_many([key_of(0)]) == [bytes([0])]  # 0 is now the newest
        plain.put_many([(key_of(9), b"nine")])  # evicts 1, the oldest
        assert fast.contains_many([key_of(i) for i in (0, 1, 2, 9)]) == [True, False, True, True]
        assert fast.stats().evictions == plain.stats().evictions == 1


def _bare_index(module: ModuleType, num_slots: int) -> tuple[np.ndarray, object]:
    meta = np.zeros((), dtype=_header_dtype(num_slots))
    return meta, make_index(meta, num_slots, module)


def test_compiled_index_refuses_bad_arguments(module: ModuleType) -> None:
    meta, index = _bare_index(module, 4)
    with pytest.raises(RuntimeError, match="32-byte digests, got 33 bytes"):
        index.find(b"x" * 33, False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"slot 4 outside the pool \(4 slots\)"):
        index.publish([4], key_of(0), [1])  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="one slot and one size per key"):
        index.publish([0, 1], key_of(0), [1])  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"slot -1 outside"):
        index.lengths([-1])  # type: ignore[attr-defined]
    header = meta.reshape(1).view(np.uint8)
    with pytest.raises(RuntimeError, match="the state column lies outside the header"):
        module.ShmIndex(header, 4, 0, 8, 16, 24, 32, header.size)


def test_compiled_index_publishes_keys_lengths_and_ticks(module: ModuleType) -> None:
    meta, index = _bare_index(module, 4)
    new, slots = index.reserve(key_of(0) + key_of(1), 10)  # type: ignore[attr-defined]
    assert (new, slots) == ([0, 1], [0, 1])
    assert list(meta["state"]) == [0, 0, 0, 0]  # reserved slots stay invisible
    index.publish(slots, key_of(0) + key_of(1), [5, 7])  # type: ignore[attr-defined]
    assert list(meta["state"]) == [1, 1, 0, 0]
    assert meta["keys"][1].tobytes() == key_of(1)
    assert list(meta["lengths"][:2]) == [5, 7]
    assert list(meta["last_used"][:2]) == [1, 2] and int(meta["clock"]) == 2
    assert index.find(key_of(1) + key_of(5) + key_of(0), True) == [1, -1, 0]  # type: ignore[attr-defined]
    assert list(meta["last_used"][:2]) == [4, 3]
    # The numpy index reads the same header the same way.
    plain = NumpyIndex.over(meta)
    assert plain.find(key_of(0) + key_of(1), False) == [0, 1]
    assert plain.lengths([0, 1]) == [5, 7]
    assert len(key_of(0)) == KEY_BYTES
