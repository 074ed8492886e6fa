"""ShmBlockPool with real processes and real POSIX shared memory."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from connectors.shm_pool import (
    ShmBlockPool,
    ShmPoolConfig,
    ShmPoolStats,
    cleanup_stale,
    lock_path,
    segment_names,
)
from kernels import cpu_kernels

pytestmark = pytest.mark.skipif(
    not Path("/dev/shm").is_dir(), reason="needs POSIX shared memory in /dev/shm"
)

SPAWN = mp.get_context("spawn")
# Spawned children import numpy from scratch; on a loaded 2-core box that is slow.
CHILD_TIMEOUT = 60.0


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def blob_of(key: bytes, slot_bytes: int) -> bytes:
    # Length and content both derive from the key, so a reader can check a
    # hit on its own, and a torn blob (two keys' bytes, or a wrong length) shows.
    size = 1 + int.from_bytes(key[:4], "little") % slot_bytes
    return (key * (size // len(key) + 1))[:size]


def leftovers(name: str) -> list[str]:
    paths = [Path("/dev/shm", segment) for segment in segment_names(name)]
    paths.append(Path(lock_path(name)))
    return [str(path) for path in paths if path.exists()]


@pytest.fixture(params=["numpy", "compiled"])
def compiled(request):
    """The slot index a pool runs on: numpy, or the compiled ShmIndex."""
    if request.param == "numpy":
        return None
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the compiled CPU kernels are not available")
    return module


@pytest.fixture
def pool_name():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    # Only matters when a test failed half-way: never leave debris in /dev/shm.
    cleanup_stale(name)


def join_ok(proc) -> None:
    proc.join(CHILD_TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == 0, f"child exited with {proc.exitcode}"


# ---- single process -------------------------------------------------------------


def test_roundtrip_contains_and_absent_keys(pool_name, compiled):
    pool = ShmBlockPool(ShmPoolConfig(pool_name, num_slots=8, slot_bytes=4096), compiled)
    keys = [key_of(i) for i in range(3)]
    blobs = [blob_of(k, 4096) for k in keys]
    as_view = np.arange(256, dtype=np.float32).data
    assert pool.put_many([*zip(keys, blobs, strict=True), (key_of(9), as_view)]) == 4

    assert pool.get_many([*keys, key_of(9), key_of(5)]) == [*blobs, as_view.tobytes(), None]
    assert pool.contains_many([keys[1], key_of(5)]) == [True, False]

    dests = [memoryview(bytearray(4096)) for _ in range(2)]
    assert pool.read_into([keys[0], key_of(5)], dests) == [len(blobs[0]), -1]
    assert bytes(dests[0][: len(blobs[0])]) == blobs[0]
    assert bytes(dests[1]) == bytes(4096)

    stats = pool.stats()
    assert (stats.num_slots, stats.used_slots, stats.evictions) == (8, 4, 0)
    assert stats.attached_processes == 1
    assert any(Path("/dev/shm", s).exists() for s in segment_names(pool_name))
    pool.close()
    pool.close()
    assert leftovers(pool_name) == []
    with pytest.raises(ValueError, match="closed"):
        pool.contains_many([keys[0]])


def test_duplicate_put_is_not_rewritten(pool_name, compiled):
    with ShmBlockPool(ShmPoolConfig(pool_name, num_slots=4, slot_bytes=64), compiled) as pool:
        key = key_of(0)
        assert pool.put_many([(key, b"first")]) == 1
        assert pool.put_many([(key, b"second")]) == 0
        assert pool.put_many([(key_of(1), b"a"), (key_of(1), b"b")]) == 1
        assert pool.get_many([key, key_of(1)]) == [b"first", b"a"]
        assert pool.stats().used_slots == 2
    assert leftovers(pool_name) == []


def test_bad_arguments_raise_value_error(pool_name, compiled):
    with pytest.raises(ValueError, match=r"name.*A-Za-z0-9"):
        ShmPoolConfig("bad/name", num_slots=1, slot_bytes=1)
    with pytest.raises(ValueError, match="name"):
        ShmPoolConfig("", num_slots=1, slot_bytes=1)
    with pytest.raises(ValueError, match="num_slots"):
        ShmPoolConfig(pool_name, num_slots=0, slot_bytes=1)
    with pytest.raises(ValueError, match="slot_bytes"):
        ShmPoolConfig(pool_name, num_slots=1, slot_bytes=-5)

    with ShmBlockPool(ShmPoolConfig(pool_name, num_slots=2, slot_bytes=16), compiled) as pool:
        with pytest.raises(ValueError, match=r"keys\[1\] must be exactly 32 bytes, got 3"):
            pool.put_many([(key_of(0), b"x"), (b"abc", b"y")])
        with pytest.raises(ValueError, match="exactly 32 bytes"):
            pool.contains_many([b"short"])
        with pytest.raises(ValueError, match=r"17 bytes, over the pool's slot_bytes=16"):
            pool.put_many([(key_of(0), b"x" * 17)])
        # A rejected batch stores nothing, not even its valid items.
        assert pool.stats().used_slots == 0

        pool.put_many([(key_of(0), b"x" * 16)])
        with pytest.raises(ValueError, match=r"dests\[0\] holds 8 bytes but its blob has 16"):
            pool.read_into([key_of(0)], [memoryview(bytearray(8))])
        with pytest.raises(ValueError, match="read-only"):
            pool.read_into([key_of(0)], [memoryview(bytes(16))])
        with pytest.raises(ValueError, match="2 keys but 1 dests"):
            pool.read_into([key_of(0), key_of(1)], [memoryview(bytearray(16))])
    assert leftovers(pool_name) == []


def test_lru_evicts_least_recently_used(pool_name, compiled):
    with ShmBlockPool(ShmPoolConfig(pool_name, num_slots=4, slot_bytes=64), compiled) as pool:
        keys = [key_of(i) for i in range(5)]
        assert pool.put_many([(k, k) for k in keys[:4]]) == 4
        assert pool.read_into([keys[0]], [memoryview(bytearray(64))]) == [32]
        assert pool.put_many([(keys[4], keys[4])]) == 1
        assert pool.contains_many(keys) == [True, False, True, True, True]
        stats = pool.stats()
        assert (stats.used_slots, stats.evictions) == (4, 1)

        # More new keys than slots: the last num_slots of them survive.
        more = [key_of(i) for i in range(10, 16)]
        assert pool.put_many([(k, k) for k in more]) == 4
        assert pool.contains_many(more) == [False, False, True, True, True, True]
        assert pool.stats().evictions == 5
    assert leftovers(pool_name) == []


# ---- several processes ---------------------------------------------------------


def _child_put(name, num_slots, slot_bytes, ids, close, results):
    pool = ShmBlockPool(ShmPoolConfig(name, num_slots, slot_bytes))
    written = pool.put_many([(key_of(i), blob_of(key_of(i), slot_bytes)) for i in ids])
    try:
        ShmBlockPool(ShmPoolConfig(name, num_slots + 1, slot_bytes))
        mismatch = ""
    except ValueError as exc:
        mismatch = str(exc)
    results.put((written, pool.stats().attached_processes, mismatch))
    if close:
        pool.close()
    # Otherwise the interpreter's normal exit has to detach it.


@pytest.mark.slow
@pytest.mark.parametrize("child_closes", [True, False], ids=["close", "exit"])
def test_child_process_writes_parent_reads(pool_name, child_closes):
    config = ShmPoolConfig(pool_name, num_slots=16, slot_bytes=64 * 1024)
    pool = ShmBlockPool(config)
    results = SPAWN.Queue()
    child = SPAWN.Process(
        target=_child_put, args=(pool_name, 16, 64 * 1024, range(10), child_closes, results)
    )
    child.start()
    written, attached, mismatch = results.get(timeout=CHILD_TIMEOUT)
    join_ok(child)

    assert (written, attached) == (10, 2)
    assert "num_slots=16, slot_bytes=65536" in mismatch
    assert "num_slots=17, slot_bytes=65536" in mismatch
    keys = [key_of(i) for i in range(10)]
    assert pool.get_many(keys) == [blob_of(k, config.slot_bytes) for k in keys]
    assert pool.stats().attached_processes == 1
    pool.close()
    assert leftovers(pool_name) == []


NUM_SHARED_KEYS = 24


def _hammer(name, num_slots, slot_bytes, seed, seconds, barrier, results, use_compiled):
    keys = [key_of(i) for i in range(NUM_SHARED_KEYS)]
    blobs = [blob_of(k, slot_bytes) for k in keys]
    rng = np.random.default_rng(seed)
    dests = [memoryview(bytearray(slot_bytes)) for _ in range(6)]
    hits = torn = 0
    error = None
    compiled = cpu_kernels.load() if use_compiled else None
    pool = ShmBlockPool(ShmPoolConfig(name, num_slots, slot_bytes), compiled)
    try:
        barrier.wait(CHILD_TIMEOUT)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            chosen = rng.choice(NUM_SHARED_KEYS, size=len(dests), replace=False).tolist()
            pool.put_many([(keys[i], blobs[i]) for i in chosen[:3]])
            lengths = pool.read_into([keys[i] for i in chosen], dests)
            for i, size, dest in zip(chosen, lengths, dests, strict=True):
                if size >= 0:
                    hits += 1
                    torn += bytes(dest[:size]) != blobs[i]
    except BaseException as exc:
        error = repr(exc)
    finally:
        pool.close()
    results.put((hits, torn, error))


@pytest.mark.slow
def test_concurrent_processes_never_read_torn_blobs(pool_name):
    # Far fewer slots than keys, so puts keep evicting slots others are reading.
    # The first worker runs the compiled index (where built), the others
    # numpy: both work on one layout, side by side.
    num_slots, slot_bytes, workers = 8, 64 * 1024, 3
    pool = ShmBlockPool(ShmPoolConfig(pool_name, num_slots, slot_bytes))
    barrier = SPAWN.Barrier(workers)
    results = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=_hammer,
            args=(pool_name, num_slots, slot_bytes, seed, 1.5, barrier, results, seed == 0),
        )
        for seed in range(workers)
    ]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=CHILD_TIMEOUT) for _ in procs]
    for proc in procs:
        join_ok(proc)

    assert [error for _, _, error in outcomes] == [None] * workers
    assert sum(torn for _, torn, _ in outcomes) == 0
    assert all(hits > 0 for hits, _, _ in outcomes)
    stats = pool.stats()
    assert stats.evictions > 0
    assert stats.attached_processes == 1
    pool.close()
    assert leftovers(pool_name) == []


def _child_attach_and_hang(name, ready):
    pool = ShmBlockPool(ShmPoolConfig(name, 4, 1024))
    pool.put_many([(key_of(0), b"from the child")])
    ready.set()
    time.sleep(CHILD_TIMEOUT)


def _spawn_and_sigkill_attached_child(name: str) -> None:
    ready = SPAWN.Event()
    child = SPAWN.Process(target=_child_attach_and_hang, args=(name, ready))
    child.start()
    try:
        assert ready.wait(CHILD_TIMEOUT)
        assert leftovers(name) != []
        assert not cleanup_stale(name), "a live attachment must keep the pool"
    finally:
        child.kill()
        child.join()


@pytest.mark.slow
def test_sigkilled_child_does_not_keep_pool_alive_past_parent_close(pool_name):
    pool = ShmBlockPool(ShmPoolConfig(pool_name, num_slots=4, slot_bytes=1024))
    _spawn_and_sigkill_attached_child(pool_name)
    assert pool.get_many([key_of(0)]) == [b"from the child"]
    assert pool.stats().attached_processes == 1
    pool.close()
    assert leftovers(pool_name) == []


@pytest.mark.slow
def test_cleanup_stale_removes_pool_of_sigkilled_process(pool_name):
    _spawn_and_sigkill_attached_child(pool_name)
    assert leftovers(pool_name) != []
    assert cleanup_stale(pool_name)
    assert leftovers(pool_name) == []
    assert not cleanup_stale(pool_name)
    assert leftovers(pool_name) == []


@pytest.mark.slow
def test_orphaned_pool_with_other_geometry_is_recreated(pool_name):
    _spawn_and_sigkill_attached_child(pool_name)
    with ShmBlockPool(ShmPoolConfig(pool_name, num_slots=2, slot_bytes=32)) as pool:
        assert pool.stats() == ShmPoolStats(2, 0, 0, 1)
    assert leftovers(pool_name) == []
