"""KV offload through real stores with the real default model.

Engine A generates (saving every full block to the store); a fresh engine B
with the same connector config then finds the shared prefix in the store
(its own cache starts empty), loads it, and must produce the same tokens.
Faults (corrupted frames, Redis down before or during a run) cost only
speed: outputs equal a run without any connector, and every engine ends
idle with all its KV blocks free.
"""

from __future__ import annotations

import glob
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from connectors.block_codec import BlockCodec
from connectors.shm_connector import ShmBlockStore
from connectors.shm_pool import segment_names
from engine.config import KVTransferConfig
from engine.kv_cache.hashing import hash_block_tokens, hash_chain
from engine.llm import LLM
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import TransferFailure
from tests.integration.redis_server import REDIS_SERVER, RedisServer

pytestmark = pytest.mark.timeout(300)

# ~20 blocks of 16 tokens shared by every prompt, then a short question.
SYSTEM = (
    "You are a careful, friendly assistant for a small bakery. You answer questions "
    "about bread, pastry, opening hours and orders. Keep answers short and precise. "
) * 11
PROMPTS = [SYSTEM + f"Question {i}: what is {i} plus {i}? Answer:" for i in range(4)]
MANY = [
    SYSTEM + f"Customer {i} asks: how many rolls are in {i + 2} dozen? Answer:" for i in range(16)
]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
# A cache of ~700 blocks: room for every test's batch, small enough that a
# dozen engines in one process stay cheap.
KV_CACHE_MEMORY = 2**29
MAX_MODEL_LEN = 1024
SHM_CAPACITY = 2**26

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server")
needs_shm = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")


def make_llm(kv: KVTransferConfig | None = None, **overrides: Any) -> LLM:
    if kv is not None:
        overrides["kv_transfer"] = kv
    return LLM(kv_cache_memory=KV_CACHE_MEMORY, max_model_len=MAX_MODEL_LEN, **overrides)


def generate(llm: LLM, prompts: list[str], deadline_s: float = 120.0) -> list[RequestOutput]:
    """llm.generate, but an engine that stops making progress (a livelock)
    fails the test after ``deadline_s`` instead of hanging it."""
    core = llm.core
    step = core.step
    deadline = time.monotonic() + deadline_s

    def guarded_step() -> Any:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"requests not finished after {deadline_s:.0f} s: "
                f"{core.scheduler.make_stats()}, waiting: "
                f"{[(r.request_id, str(r.status)) for r in core.scheduler.waiting]}"
            )
        return step()

    setattr(core, "step", guarded_step)  # noqa: B010 (mypy: no method assignment)
    try:
        return llm.generate(prompts, PARAMS, use_tqdm=False)
    finally:
        delattr(core, "step")


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def assert_idle(llm: LLM) -> None:
    """No request left running or waiting, every KV block free, and the
    connector healthy."""
    stats = llm.core.scheduler.make_stats()
    assert stats is not None
    assert stats.num_running_reqs == 0
    assert stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == 0
    assert llm.core.connector_health() is None


def mget_calls(client: Any) -> int:
    """How many MGETs (block loads) Redis has served."""
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_mget", {}).get("calls", 0))


def redis_kv(server: RedisServer) -> KVTransferConfig:
    return KVTransferConfig("redis", "kv_both", {"url": server.url, "socket_timeout": 1.0})


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[int]]:
    """Greedy tokens of every prompt from an engine without a connector."""
    llm = make_llm()
    try:
        outs = generate(llm, PROMPTS) + generate(llm, MANY)
        assert_idle(llm)
    finally:
        llm.core.shutdown()
    result = {p: list(o.token_ids) for p, o in zip(PROMPTS + MANY, outs, strict=True)}
    shared_tokens = len(llm.tokenizer(SYSTEM).input_ids)
    assert shared_tokens >= 18 * 16, "the shared prefix should span ~20 blocks"
    return result


def expected(baseline: dict[str, list[int]], prompts: list[str]) -> list[list[int]]:
    return [baseline[p] for p in prompts]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("needs redis-server")
    with RedisServer() as server:
        yield server


def populate(kv: KVTransferConfig, prompts: list[str], baseline: dict[str, list[int]]) -> None:
    """Engine A: generate (saving to the store), then shut down."""
    llm = make_llm(kv)
    try:
        assert tokens(generate(llm, prompts)) == expected(baseline, prompts)
        assert_idle(llm)
    finally:
        llm.core.shutdown()


# ---- the round trip ------------------------------------------------------------


@needs_redis
def test_redis_second_engine_loads_the_prefix(
    redis_server: RedisServer, baseline: dict[str, list[int]]
) -> None:
    kv = redis_kv(redis_server)
    populate(kv, PROMPTS, baseline)
    client = redis_server.client()
    keys_after_a = client.dbsize()
    assert keys_after_a >= 20

    assert mget_calls(client) == 0  # A found nothing to load

    llm = make_llm(kv)
    try:
        outs = generate(llm, PROMPTS)
        assert tokens(outs) == expected(baseline, PROMPTS)
        # B's own cache was empty: the hit can only come from Redis.
        assert outs[0].num_cached_tokens >= 16 * 16
        assert all(o.num_cached_tokens > 0 for o in outs)
        assert_idle(llm)
    finally:
        llm.core.shutdown()
    assert mget_calls(client) > 0
    # B computed exactly what A did: no key is new.
    assert client.dbsize() == keys_after_a


@needs_shm
def test_shm_second_engine_loads_the_prefix(baseline: dict[str, list[int]]) -> None:
    """Same over a shared-memory pool. The pool lives while an engine has it
    open, so A stays up while B runs; once both are shut down no segment of
    the pool is left in /dev/shm."""
    pool = f"test-{uuid.uuid4().hex[:12]}"
    kv = KVTransferConfig("shm", "kv_both", {"pool_name": pool, "capacity_bytes": SHM_CAPACITY})
    engines: list[LLM] = []
    try:
        a = make_llm(kv)
        engines.append(a)
        assert tokens(generate(a, PROMPTS)) == expected(baseline, PROMPTS)
        assert_idle(a)
        ctx = a.core._connector_context()
        namespace = BlockCodec(ctx.model_name, ctx.layout).namespace
        segments = [Path("/dev/shm", n) for n in segment_names(f"{pool}-{namespace}")]
        assert all(path.exists() for path in segments)

        b = make_llm(kv)
        engines.append(b)
        outs = generate(b, PROMPTS)
        assert tokens(outs) == expected(baseline, PROMPTS)
        assert outs[0].num_cached_tokens >= 16 * 16
        assert_idle(b)
    finally:
        for llm in engines:
            llm.core.shutdown()
    assert not any(path.exists() for path in segments)
    assert glob.glob(f"/dev/shm/tandem-{pool}*") == []


# ---- faults --------------------------------------------------------------------


def first_block_key(llm: LLM, prompt: str) -> bytes:
    """The Redis key of the first block of ``prompt`` (default key prefix)."""
    ctx = llm.core._connector_context()
    codec = BlockCodec(ctx.model_name, ctx.layout)
    token_ids = llm.inputs.tokenize(prompt)
    first = hash_block_tokens(None, token_ids[: ctx.layout.block_size])
    return codec.text_key(first, "tandem:").encode()


@needs_redis
@pytest.mark.parametrize(
    "spare_first_block",
    [
        False,
        True,
    ],
    ids=["all-corrupt", "all-but-first-corrupt"],
)
def test_redis_corrupted_blocks_are_recomputed(
    redis_server: RedisServer, baseline: dict[str, list[int]], spare_first_block: bool
) -> None:
    """Every stored frame (or every one but the prompts' first block) has a
    flipped payload byte: B's loads fail their checksum and B recomputes the
    bad blocks, with unchanged outputs."""
    kv = redis_kv(redis_server)
    llm = make_llm(kv)
    try:
        assert tokens(generate(llm, PROMPTS)) == expected(baseline, PROMPTS)
        spared = first_block_key(llm, PROMPTS[0])
    finally:
        llm.core.shutdown()
    client = redis_server.client()
    keys = list(client.scan_iter(count=1000))
    assert len(keys) >= 20
    assert spared in keys
    for key in keys:
        if spare_first_block and key == spared:
            continue
        value = bytearray(cast(bytes, client.get(key)))
        assert len(value) > 64
        value[-1] ^= 0xFF
        client.set(key, bytes(value))

    llm = make_llm(kv)
    try:
        outs = generate(llm, PROMPTS)
        assert tokens(outs) == expected(baseline, PROMPTS)
        assert_idle(llm)
    finally:
        llm.core.shutdown()


@needs_redis
def test_redis_down_before_the_run_then_back(
    redis_server: RedisServer, baseline: dict[str, list[int]]
) -> None:
    """Redis dies after A saved: B finds nothing (lookups and saves fail)
    and recomputes. Redis comes back empty on the same port: a third engine
    C completes and saves again."""
    kv = redis_kv(redis_server)
    populate(kv, PROMPTS, baseline)
    redis_server.kill()

    llm = make_llm(kv)
    try:
        started = time.monotonic()
        outs = generate(llm, PROMPTS)
        assert time.monotonic() - started < 60
        assert tokens(outs) == expected(baseline, PROMPTS)
        assert_idle(llm)
        # It really could not reach Redis (and said so, without failing).
        store = getattr(llm.core.scheduler.kv_transfers.connector, "store", None)
        assert "Connection" in str(getattr(store, "last_error", ""))
    finally:
        llm.core.shutdown()

    redis_server.start()
    client = redis_server.client()
    assert client.dbsize() == 0
    llm = make_llm(kv)
    try:
        outs = generate(llm, PROMPTS)
        assert tokens(outs) == expected(baseline, PROMPTS)
        assert_idle(llm)
    finally:
        llm.core.shutdown()
    assert client.dbsize() >= 20


@needs_redis
def test_redis_killed_during_the_run(
    redis_server: RedisServer, baseline: dict[str, list[int]]
) -> None:
    """Redis is killed while B works through 16 requests, four at a time
    (lookups, loads and saves in flight): every request completes with the
    same tokens."""
    kv = redis_kv(redis_server)
    populate(kv, MANY, baseline)

    llm = make_llm(kv, max_num_seqs=4)
    killed_at_step: list[int] = []
    stop = threading.Event()

    def killer() -> None:
        while not stop.is_set():
            if llm.totals.num_steps >= 3:
                redis_server.kill()
                killed_at_step.append(llm.totals.num_steps)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=killer, name="redis-killer", daemon=True)
    try:
        thread.start()
        outs = generate(llm, MANY)
        stop.set()
        thread.join(10)
        assert killed_at_step, "Redis was not killed during the run"
        assert killed_at_step[0] < llm.totals.num_steps
        assert not redis_server.running
        assert tokens(outs) == expected(baseline, MANY)
        assert_idle(llm)
    finally:
        stop.set()
        llm.core.shutdown()


# ---- frames under the wrong keys ------------------------------------------------

# Another user's prompt: its frames are valid, their KV is not the victim's.
OTHER = "Write a short poem about the sea, the wind and a lighthouse keeper at night. " * 6


@dataclass
class StoreAccess:
    """Raw frames of a store by block hash, behind the connector's back."""

    get: Callable[[bytes], bytes]
    put: Callable[[bytes, bytes], None]


def block_keys(llm: LLM, prompt: str) -> list[bytes]:
    """The block hashes of ``prompt``'s full blocks (no LoRA, no salt)."""
    return hash_chain(llm.inputs.tokenize(prompt), llm.core._connector_context().layout.block_size)


def misplace(access: StoreAccess, victim: list[bytes], other: list[bytes], how: str) -> None:
    """``wrong-key``: the other prompt's third frame written under the
    victim's third key; ``swapped``: the victim's fourth and fifth frames
    trade places."""
    if how == "wrong-key":
        access.put(victim[2], access.get(other[2]))
    else:
        fourth, fifth = access.get(victim[3]), access.get(victim[4])
        access.put(victim[3], fifth)
        access.put(victim[4], fourth)


def corrupt_loads(llm: LLM) -> int:
    stats = llm.core.scheduler.make_stats()
    assert stats is not None
    return stats.kv_connector_totals.failures.get(TransferFailure.CORRUPT, 0)


def run_victim(llm: LLM, baseline: dict[str, list[int]]) -> None:
    """The victim's prompt on an engine that finds misplaced frames: the
    same tokens as without a connector, and one load counted corrupt."""
    assert tokens(generate(llm, PROMPTS[:1])) == expected(baseline, PROMPTS[:1])
    assert corrupt_loads(llm) == 1
    assert_idle(llm)


MISPLACEMENTS = ["wrong-key", "swapped"]


@needs_redis
@pytest.mark.parametrize("how", MISPLACEMENTS)
def test_redis_frames_under_the_wrong_keys_are_counted_misses(
    redis_server: RedisServer, baseline: dict[str, list[int]], how: str
) -> None:
    """Another prompt's valid frame written under the victim's key, or two
    of the victim's frames swapped, in Redis: the next engine rejects them
    (a miss, counted corrupt) and recomputes; the answer is unchanged."""
    kv = redis_kv(redis_server)
    llm = make_llm(kv)
    try:
        assert tokens(generate(llm, PROMPTS[:1])) == expected(baseline, PROMPTS[:1])
        generate(llm, [OTHER])
        ctx = llm.core._connector_context()
        # The weights' format reaches the connectors (their namespace), and
        # int8 activations where on (the default model's default).
        assert ctx.layout.weight_format.split(" ")[0] == llm.core.info.weight_format != ""
        codec = BlockCodec(ctx.model_name, ctx.layout)
        victim, other = block_keys(llm, PROMPTS[0]), block_keys(llm, OTHER)
    finally:
        llm.core.shutdown()
    client = redis_server.client()

    def key(block_hash: bytes) -> str:
        return codec.text_key(block_hash, "tandem:")

    def get(block_hash: bytes) -> bytes:
        value = client.get(key(block_hash))
        assert value is not None, "the first engine did not save the block"
        return cast(bytes, value)

    def put(block_hash: bytes, frame: bytes) -> None:
        client.set(key(block_hash), frame)

    misplace(StoreAccess(get, put), victim, other, how)
    llm = make_llm(kv)
    try:
        run_victim(llm, baseline)
    finally:
        llm.core.shutdown()
    assert mget_calls(client) > 0


@needs_shm
@pytest.mark.parametrize("how", MISPLACEMENTS)
def test_shm_frames_under_the_wrong_keys_are_counted_misses(
    baseline: dict[str, list[int]], how: str
) -> None:
    """The same in a shared-memory pool (the frames moved in place, in
    their slots): the second engine's load rejects them. Loads are
    synchronous here: the step that loaded them is void, and its token,
    which the runner had appended, is re-synced (a failed synchronous load
    once left the request waiting forever)."""
    pool = f"test-{uuid.uuid4().hex[:12]}"
    extra = {"pool_name": pool, "capacity_bytes": SHM_CAPACITY, "load_async": False}
    kv = KVTransferConfig("shm", "kv_both", extra)
    engines: list[LLM] = []
    try:
        a = make_llm(kv)
        engines.append(a)
        assert tokens(generate(a, PROMPTS[:1])) == expected(baseline, PROMPTS[:1])
        generate(a, [OTHER])
        store = getattr(a.core.scheduler.kv_transfers.connector, "store", None)
        assert isinstance(store, ShmBlockStore)
        misplace(shm_access(store), block_keys(a, PROMPTS[0]), block_keys(a, OTHER), how)
        b = make_llm(kv)
        engines.append(b)
        run_victim(b, baseline)
    finally:
        for llm in engines:
            llm.core.shutdown()


def shm_access(store: ShmBlockStore) -> StoreAccess:
    def get(block_hash: bytes) -> bytes:
        (frame,) = store.pool.get_many([store.codec.digest_key(block_hash)])
        assert frame is not None, "the first engine did not save the block"
        return frame

    def put(block_hash: bytes, frame: bytes) -> None:
        def write(data: Any, indices: list[int], slots: list[int], lengths: list[int]) -> None:
            assert slots, "no slot to overwrite"
            data[slots[0], : len(frame)] = np.frombuffer(frame, np.uint8)

        store.pool.read_with([store.codec.digest_key(block_hash)], write)

    return StoreAccess(get, put)
