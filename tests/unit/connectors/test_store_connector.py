"""StoreConnector, both halves, over an in-memory BlockStore test double.

Scheduler half: lookups (leading stored blocks past the local hit, never the
block of the last prompt token; non-blocking for a network store), saves
(once per block hash), P/D remote prefill and request_finished. Worker half:
loads (sync and async) land in a real paged cache, bad frames come back as
invalid block ids, saves are copied out and framed.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from connectors.block_codec import HEADER_BYTES, BlockCodec
from connectors.kv_blocks import KVBlockIO
from connectors.store import BlockStore
from connectors.store_connector import (
    LoadSpec,
    StoreConnector,
    StoreConnectorMetadata,
    StoreOptions,
)
from engine.config import KVTransferConfig
from engine.kv_cache.hashing import BlockHasher
from engine.kv_transfer.base import ConnectorContext, KVConnectorRole, KVLayout
from engine.kv_transfer.options import option
from engine.kv_transfer.params import KVTransferParams
from engine.outputs import KVConnectorOutput, ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.stats import TransferFailure
from tests.unit.engine.sched.harness import free_blocks, make_scheduler, step

BS = 8
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS, dtype="float32")
MODEL = "test-model"
ENGINE_ID = "engine-a"
NUM_CACHE_BLOCKS = 16
TIMEOUT = 10.0


class DictStore:
    """A BlockStore in a dict. ``gate`` (set by default) holds every lookup
    while cleared, as a slow network store would."""

    def __init__(self, *, local_lookups: bool = True) -> None:
        self.local_lookups = local_lookups
        self.last_error: str | None = None
        self.frames: dict[bytes, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.lookups: list[list[bytes]] = []
        self.puts: list[bytes] = []
        self.closed = False
        self.fail_get: Exception | None = None

    def contains_many(self, hashes: Sequence[bytes]) -> list[bool]:
        assert self.gate.wait(TIMEOUT)
        self.lookups.append(list(hashes))
        return [h in self.frames for h in hashes]

    def read_into(self, hashes: Sequence[bytes], frames: np.ndarray) -> list[int]:
        if self.fail_get is not None:
            raise self.fail_get
        lengths = []
        for row, h in zip(frames, hashes, strict=True):
            frame = self.frames.get(h)
            if frame is not None and len(frame) == len(row):
                row[:] = np.frombuffer(frame, np.uint8)
            lengths.append(-1 if frame is None else len(frame))
        return lengths

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> bool:
        for h, frame in items:
            self.frames[h] = bytes(frame)
            self.puts.append(h)
        return True

    def close(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class DictOptions(StoreOptions):
    store: Any = option(None, "the DictStore the connector uses")


class DictConnector(StoreConnector):
    """The store comes in through the extra config (key ``store``), which its
    options declare as a store's own options extend ``StoreOptions``."""

    default_load_async = False
    options_class = DictOptions

    def make_store(self, context: ConnectorContext) -> BlockStore:
        store: DictStore = DictOptions.of(context.config).store
        return store


def make_connector(
    store: DictStore,
    role: KVConnectorRole = KVConnectorRole.SCHEDULER,
    kv_role: str = "kv_both",
    **extra: Any,
) -> DictConnector:
    config = KVTransferConfig("dict", kv_role, {"store": store, **extra})  # type: ignore[arg-type]
    return DictConnector(role, ConnectorContext(config, MODEL, LAYOUT, ENGINE_ID))


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int = 4,
    kv_transfer_params: KVTransferParams | None = None,
) -> Request:
    return Request(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens),
        eos_token_id=2,
        options=RequestOptions(kv_transfer_params=kv_transfer_params),
        block_hasher=BlockHasher(BS),
    )


def prompt_of(num_tokens: int, start: int = 100) -> list[int]:
    return list(range(start, start + num_tokens))


def store_blocks(store: DictStore, request: Request, indices: Sequence[int]) -> None:
    for i in indices:
        store.frames[request.block_hashes[i]] = b"frame"


def wait_for(predicate: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.002)
    raise AssertionError("timed out waiting")


# ==== scheduler half: lookups =================================================


@pytest.mark.parametrize(
    ("stored", "expected_blocks"),
    [
        ([], 0),
        ([0], 1),
        ([0, 1], 2),
        ([0, 1, 3], 2),  # stops at the first missing block
        ([1, 2, 3], 0),  # nothing usable without block 0
        ([0, 1, 2, 3], 4),
    ],
)
def test_lookup_counts_leading_stored_blocks(stored: list[int], expected_blocks: int) -> None:
    """4 blocks + 1 token: four full blocks, the last prompt token alone in
    block 4;
    the count is the run of stored blocks from block 0, in tokens."""
    store = DictStore()
    conn = make_connector(store)
    request = make_request("r1", prompt_of(4 * BS + 1))
    assert len(request.block_hashes) == 4
    store_blocks(store, request, stored)
    assert conn.get_num_new_matched_tokens(request, 0) == (expected_blocks * BS, False)


@pytest.mark.parametrize("num_tokens", [4 * BS, 3 * BS + 1])
def test_lookup_never_counts_the_block_of_the_last_prompt_token(num_tokens: int) -> None:
    """4 blocks' worth of tokens fill four blocks, but the last one holds the
    last prompt token, which is always computed: only three blocks may load.
    3 blocks + 1 token: three full blocks, the last prompt token in the fourth."""
    store = DictStore()
    conn = make_connector(store)
    request = make_request("r1", prompt_of(num_tokens))
    store_blocks(store, request, range(len(request.block_hashes)))
    ext, _ = conn.get_num_new_matched_tokens(request, 0)
    assert ext == 3 * BS
    assert ext < request.num_tokens
    assert store.lookups == [request.block_hashes[:3]]


def test_lookup_of_a_one_block_prompt_does_not_ask_the_store() -> None:
    store = DictStore()
    conn = make_connector(store)
    request = make_request("r1", prompt_of(BS))
    store_blocks(store, request, [0])
    assert conn.get_num_new_matched_tokens(request, 0) == (0, False)
    assert store.lookups == []


def test_lookup_counts_past_the_local_prefix_hit() -> None:
    """With two blocks already in the local cache only blocks 2.. are looked
    up, and only they count (block 0 missing from the store is irrelevant)."""
    store = DictStore()
    conn = make_connector(store)
    request = make_request("r1", prompt_of(4 * BS + 1))
    store_blocks(store, request, [2, 3])
    assert conn.get_num_new_matched_tokens(request, 2 * BS) == (2 * BS, False)
    assert store.lookups == [request.block_hashes[2:4]]
    # The local hit already covers everything loadable.
    assert conn.get_num_new_matched_tokens(request, 4 * BS) == (0, False)


def test_lookup_with_load_async_reports_async_only_for_hits() -> None:
    store = DictStore()
    conn = make_connector(store, load_async=True)
    hit = make_request("r1", prompt_of(4 * BS + 1))
    store_blocks(store, hit, range(4))
    assert conn.get_num_new_matched_tokens(hit, 0) == (4 * BS, True)
    miss = make_request("r2", prompt_of(4 * BS + 1, start=500))
    assert conn.get_num_new_matched_tokens(miss, 0) == (0, False)


def test_producer_only_never_looks_up() -> None:
    store = DictStore()
    conn = make_connector(store, kv_role="kv_producer")
    request = make_request("r1", prompt_of(4 * BS + 1))
    store_blocks(store, request, range(4))
    assert conn.get_num_new_matched_tokens(request, 0) == (0, False)
    assert store.lookups == []


def test_blocking_store_lookup_is_asynchronous() -> None:
    """A network store is never asked on the scheduler thread: the first
    call returns None (ask again), so do calls while the lookup runs; once
    it finished the count comes back. One lookup per request."""
    store = DictStore(local_lookups=False)
    conn = make_connector(store, load_async=True)
    request = make_request("r1", prompt_of(4 * BS + 1))
    store_blocks(store, request, range(3))
    store.gate.clear()
    try:
        assert conn.get_num_new_matched_tokens(request, 0) == (None, False)
        assert conn.get_num_new_matched_tokens(request, 0) == (None, False)
    finally:
        store.gate.set()
    result = wait_for(lambda: conn.get_num_new_matched_tokens(request, 0)[0] is not None and 1)
    assert result
    assert conn.get_num_new_matched_tokens(request, 0) == (3 * BS, True)
    assert store.lookups == [request.block_hashes[:4]]
    conn.shutdown()


def test_blocking_store_lookup_is_cancelled_when_the_request_finishes() -> None:
    store = DictStore(local_lookups=False)
    conn = make_connector(store)
    first = make_request("r1", prompt_of(4 * BS + 1))
    second = make_request("r2", prompt_of(4 * BS + 1, start=300))
    store.gate.clear()
    try:
        assert conn.get_num_new_matched_tokens(first, 0) == (None, False)
        assert conn.get_num_new_matched_tokens(second, 0) == (None, False)
        # r2's lookup is queued behind r1's; finishing r2 drops it.
        assert conn.request_finished(second, []) == (False, None)
    finally:
        store.gate.set()
    wait_for(lambda: conn.get_num_new_matched_tokens(first, 0)[0] is not None)
    time.sleep(0.05)
    assert store.lookups == [first.block_hashes[:4]]
    conn.shutdown()


def lookup_until_known(
    conn: DictConnector, request: Request, num_computed_tokens: int
) -> tuple[int | None, bool]:
    """Ask as the scheduler does, step after step, until the count is known."""

    def ask() -> tuple[int | None, bool] | None:
        got = conn.get_num_new_matched_tokens(request, num_computed_tokens)
        return got if got[0] is not None else None

    answer: tuple[int | None, bool] = wait_for(ask)
    return answer


@pytest.mark.parametrize(
    ("stored", "expected_blocks"), [([0, 1, 2, 3], 2), ([0, 1, 2], 1), ([0, 1], 0)]
)
def test_blocking_lookup_result_respects_a_grown_local_hit(
    stored: list[int], expected_blocks: int
) -> None:
    """The lookup started when nothing was cached locally; by the time it
    finished, two blocks are in the local cache. The count is of the stored
    blocks past those two, so it still leaves the last prompt token to
    compute (the connector contract)."""
    store = DictStore(local_lookups=False)
    conn = make_connector(store, load_async=True)
    request = make_request("r1", prompt_of(4 * BS + 1))
    store_blocks(store, request, stored)
    try:
        assert conn.get_num_new_matched_tokens(request, 0) == (None, False)
        assert lookup_until_known(conn, request, 0)[0] == len(stored) * BS
        ext, load_async = conn.get_num_new_matched_tokens(request, 2 * BS)
    finally:
        conn.shutdown()
    assert (ext, load_async) == (expected_blocks * BS, expected_blocks > 0)
    assert len(store.lookups) == 1


def test_blocking_lookup_is_redone_when_the_local_hit_shrank() -> None:
    """A lookup that started past a local hit of two blocks does not cover
    blocks 0-1; once those were evicted locally, it is not used."""
    store = DictStore(local_lookups=False)
    conn = make_connector(store, load_async=True)
    request = make_request("r1", prompt_of(4 * BS + 1))
    store_blocks(store, request, range(4))
    try:
        assert lookup_until_known(conn, request, 2 * BS) == (2 * BS, True)
        assert conn.get_num_new_matched_tokens(request, 0) == (None, False)
        assert lookup_until_known(conn, request, 0) == (4 * BS, True)
    finally:
        conn.shutdown()
    assert store.lookups == [request.block_hashes[2:4], request.block_hashes[0:4]]


def step_until(sched: Scheduler, done: Callable[[], bool], max_steps: int = 2000) -> list[Any]:
    """Step (as an engine does, polling) until ``done()``; returns each
    step's connector metadata."""
    metas: list[Any] = []
    for _ in range(max_steps):
        if done():
            return metas
        metas.append(step(sched).sched_out.kv_connector_metadata)
        time.sleep(0.001)
    raise AssertionError("condition not reached")


def test_lookup_racing_a_local_hit_through_the_scheduler() -> None:
    """How a stale lookup happens in an engine: r2's lookup is in flight (a
    slow store) while r1, sharing r2's first two blocks, loads them and puts
    them in the local prefix cache. When r2's lookup finishes, the scheduler
    sees a local hit of two blocks plus what the connector claims: together
    they stay within r2's prompt, and the load pairs each block id with its
    hash."""
    store = DictStore(local_lookups=False)
    conn = make_connector(store, load_async=True)
    sched = make_scheduler(block_size=BS, num_blocks=64, connector=conn)
    long_prompt = prompt_of(4 * BS + 1)
    r1 = make_request("r1", long_prompt[: 2 * BS + 1])
    r2 = make_request("r2", long_prompt)
    store_blocks(store, r2, range(4))  # r1's two blocks are r2's first two
    try:
        sched.add_request(r1)
        step_until(sched, lambda: r1.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        store.gate.clear()
        sched.add_request(r2)
        step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"r1"}))
        step(sched)  # r1 resumes: its two blocks enter the local prefix cache
        statuses = {r.request_id: r.status for r in (r1, r2)}
        assert statuses == {"r1": RequestStatus.RUNNING, "r2": RequestStatus.WAITING}
        store.gate.set()
        metas = step_until(sched, lambda: r2.status != RequestStatus.WAITING)
    finally:
        store.gate.set()
        conn.shutdown()
    loads = [spec for m in metas for spec in m.loads if spec.req_id == "r2"]
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert r2.num_external_computed_tokens == 2 * BS
    (spec,) = loads
    assert spec.hashes == r2.block_hashes[2:4]
    assert len(spec.block_ids) == 2


# ==== scheduler half: saves, driven by a real Scheduler =======================


def saves_of(result_meta: Any) -> list[tuple[int, bytes]]:
    assert isinstance(result_meta, StoreConnectorMetadata)
    return list(result_meta.saves)


def run_collecting_saves(
    sched: Scheduler, max_steps: int = 200
) -> tuple[list[list[tuple[int, bytes]]], dict[str, Any]]:
    """Step to completion; returns each step's saves and each finished
    request's final output."""
    per_step: list[list[tuple[int, bytes]]] = []
    finals: dict[str, Any] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return per_step, finals
        res = step(sched)
        per_step.append(saves_of(res.sched_out.kv_connector_metadata))
        for out in res.outputs:
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("requests did not finish")


@pytest.fixture
def saving() -> Iterator[tuple[DictStore, DictConnector]]:
    store = DictStore()
    conn = make_connector(store)
    yield store, conn
    conn.shutdown()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_each_block_hash_is_saved_once(
    saving: tuple[DictStore, DictConnector], prefix_caching: bool
) -> None:
    """Chunked prefill completes blocks over several steps: each full block
    is listed for saving once, in the step that completes it, with the block
    id it occupies. A second request with the same prompt (from the local
    prefix cache, or recomputed without one) lists none of the shared blocks
    again; only its own new blocks."""
    store, conn = saving
    sched = make_scheduler(
        block_size=BS,
        num_blocks=64,
        max_num_batched_tokens=12,
        connector=conn,
        prefix_caching=prefix_caching,
    )
    prompt = prompt_of(4 * BS + 2)
    first = make_request("r1", prompt, max_tokens=7)
    sched.add_request(first)
    per_step, _ = run_collecting_saves(sched)
    listed = [s for step_saves in per_step for s in step_saves]
    store_blocks(store, first, range(5))  # what the worker did with them
    # 4 blocks + 2 prompt tokens, 6 computed output tokens: five full blocks.
    assert [h for _, h in listed] == first.block_hashes[:5]
    assert len({h for _, h in listed}) == 5
    # Saves come as blocks fill, not all at the end.
    assert sum(1 for step_saves in per_step if step_saves) >= 3
    # The block id listed is the one the request's block table had there.
    assert all(0 < block_id < 64 for block_id, _ in listed)
    assert len({block_id for block_id, _ in listed}) == 5

    second = make_request("r2", prompt, max_tokens=7)
    sched.add_request(second)
    per_step, _ = run_collecting_saves(sched)
    listed_again = [h for step_saves in per_step for _, h in step_saves]
    assert not set(listed_again) & set(first.block_hashes[:4])
    # Its fifth block differs (other output tokens) and is saved once.
    assert second.block_hashes[4] != first.block_hashes[4]
    assert listed_again == [second.block_hashes[4]]
    assert free_blocks(sched) == 63


def test_blocks_the_store_lost_are_saved_again(saving: tuple[DictStore, DictConnector]) -> None:
    """The store restarted empty (or evicted): a lookup that finds a block
    missing forgets it was saved, so computing it again saves it again."""
    store, conn = saving
    sched = make_scheduler(block_size=BS, num_blocks=64, connector=conn, prefix_caching=False)
    prompt = prompt_of(4 * BS + 2)
    sched.add_request(make_request("r1", prompt, max_tokens=1))
    first, _ = run_collecting_saves(sched)
    saved = [h for step_saves in first for _, h in step_saves]
    assert len(saved) == 4
    store.frames.clear()
    sched.add_request(make_request("r2", prompt, max_tokens=1))
    again, _ = run_collecting_saves(sched)
    assert [h for step_saves in again for _, h in step_saves] == saved


def test_consumer_only_saves_nothing() -> None:
    store = DictStore()
    conn = make_connector(store, kv_role="kv_consumer")
    sched = make_scheduler(block_size=BS, num_blocks=64, connector=conn)
    sched.add_request(make_request("r1", prompt_of(4 * BS + 2)))
    per_step, _ = run_collecting_saves(sched)
    assert not any(per_step)


def test_blocks_loaded_from_the_store_are_not_saved_back() -> None:
    """A request whose prefix came from the store lists only the blocks it
    computed itself."""
    store = DictStore()
    conn = make_connector(store)
    sched = make_scheduler(block_size=BS, num_blocks=64, connector=conn)
    request = make_request("r1", prompt_of(4 * BS + 2), max_tokens=2)
    store_blocks(store, request, [0, 1, 2])
    sched.add_request(request)
    per_step, _ = run_collecting_saves(sched)
    listed = [h for step_saves in per_step for _, h in step_saves]
    assert listed == [request.block_hashes[3]]
    assert request.num_cached_tokens == 3 * BS


# ==== scheduler half: P/D ======================================================


def test_remote_prefill_is_async_and_capped_by_num_blocks() -> None:
    """A do_remote_prefill request does not ask the store (the producer said
    what it saved): it loads min(num_blocks, loadable blocks) asynchronously."""
    store = DictStore(local_lookups=False)
    store.gate.clear()  # a lookup would hang: there must be none
    conn = make_connector(store, kv_role="kv_consumer")

    def remote(num_blocks: int | None, num_tokens: int = 4 * BS + 2) -> Request:
        params = KVTransferParams(do_remote_prefill=True, num_blocks=num_blocks)
        return make_request("r", prompt_of(num_tokens), kv_transfer_params=params)

    try:
        assert conn.get_num_new_matched_tokens(remote(2), 0) == (2 * BS, True)
        assert conn.get_num_new_matched_tokens(remote(None), 0) == (4 * BS, True)
        assert conn.get_num_new_matched_tokens(remote(10), 0) == (4 * BS, True)
        # 4 blocks' worth: the fourth block holds the last prompt token.
        assert conn.get_num_new_matched_tokens(remote(10, 4 * BS), 0) == (3 * BS, True)
        assert conn.get_num_new_matched_tokens(remote(0), 0) == (0, False)
        assert conn.get_num_new_matched_tokens(remote(2), 2 * BS) == (0, False)
        assert conn.get_num_new_matched_tokens(remote(3), 2 * BS) == (BS, True)
        assert store.lookups == []
    finally:
        store.gate.set()
        conn.shutdown()


def test_remote_prefill_through_the_scheduler() -> None:
    """The request waits in WAITING_FOR_REMOTE_KVS with a load that waits for
    the producer; once the worker reports it, it resumes past the loaded
    tokens."""
    store = DictStore()
    conn = make_connector(store, kv_role="kv_consumer")
    sched = make_scheduler(block_size=BS, num_blocks=64, connector=conn)
    request = make_request(
        "r1",
        prompt_of(4 * BS + 2),
        kv_transfer_params=KVTransferParams(do_remote_prefill=True, num_blocks=2),
    )
    sched.add_request(request)
    first = step(sched)
    meta = first.sched_out.kv_connector_metadata
    assert isinstance(meta, StoreConnectorMetadata)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert first.scheduled == {}
    (spec,) = meta.loads
    assert spec.req_id == "r1"
    assert spec.hashes == request.block_hashes[:2]
    assert len(spec.block_ids) == 2
    assert spec.is_async and spec.wait_for_producer
    assert not meta.saves
    # The load is handed over once.
    again = step(sched).sched_out.kv_connector_metadata
    assert isinstance(again, StoreConnectorMetadata) and not again.loads
    step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"r1"}))
    resumed = step(sched)
    assert resumed.scheduled == {"r1": 2 * BS + 2}
    while sched.has_unfinished_requests():
        step(sched)
    assert request.num_cached_tokens == 2 * BS
    assert free_blocks(sched) == 63
    conn.shutdown()


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_both"])
def test_request_finished_returns_params_for_remote_decode(kv_role: str) -> None:
    """A producer's do_remote_decode request finishes with the params a
    decode engine needs: where to load from and how many blocks were saved;
    the blocks are freed at once (they were copied out when computed)."""
    store = DictStore()
    conn = make_connector(store, kv_role=kv_role)
    sched = make_scheduler(block_size=BS, num_blocks=64, connector=conn)
    request = make_request(
        "r1",
        prompt_of(4 * BS + 2),
        max_tokens=1,
        kv_transfer_params=KVTransferParams(do_remote_decode=True),
    )
    other = make_request("r2", prompt_of(4 * BS + 2, start=700), max_tokens=1)
    sched.add_request(request)
    sched.add_request(other)
    _, finals = run_collecting_saves(sched)
    assert finals["r1"].kv_transfer_params == KVTransferParams(
        do_remote_prefill=True, kv_connector="dict", remote_engine_id=ENGINE_ID, num_blocks=4
    )
    assert finals["r2"].kv_transfer_params is None
    assert free_blocks(sched) == 63

    # The decode side takes those params as its request's kv_transfer_params.
    consumer = make_connector(DictStore(), kv_role="kv_consumer")
    decode = make_request(
        "d1", prompt_of(4 * BS + 2), kv_transfer_params=finals["r1"].kv_transfer_params
    )
    assert consumer.get_num_new_matched_tokens(decode, 0) == (4 * BS, True)
    conn.shutdown()


def test_consumer_returns_no_params_for_remote_decode() -> None:
    conn = make_connector(DictStore(), kv_role="kv_consumer")
    request = make_request(
        "r1", prompt_of(4 * BS + 2), kv_transfer_params=KVTransferParams(do_remote_decode=True)
    )
    assert conn.get_num_new_matched_tokens(request, 0) == (0, False)
    assert conn.request_finished(request, [1, 2]) == (False, None)


# ==== worker half ==============================================================


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


class Worker:
    """A worker-role connector over a zeroed two-layer paged cache, and a
    source cache whose blocks are framed into the store."""

    def __init__(self, store: DictStore, num_blocks: int = NUM_CACHE_BLOCKS, **extra: Any) -> None:
        self.store = store
        self.codec = BlockCodec(MODEL, LAYOUT)
        shape = (2, num_blocks, BS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        gen = torch.Generator().manual_seed(0)
        self.source = [torch.randn(shape, generator=gen) for _ in range(LAYOUT.num_layers)]
        self.caches = [torch.zeros(shape) for _ in range(LAYOUT.num_layers)]
        self.conn = make_connector(store, KVConnectorRole.WORKER, **extra)
        self.conn.register_kv_caches({f"layer.{i}": c for i, c in enumerate(self.caches)})

    def frame_of_source(self, block: int, key: bytes) -> bytes:
        """Source block ``block`` framed for storing under ``key``."""
        (payload,) = KVBlockIO(self.source).gather([block])
        return self.codec.encode(payload, key)

    def run_step(self, meta: StoreConnectorMetadata) -> None:
        """The hooks model_runner.execute_model calls around a forward."""
        self.conn.bind_connector_metadata(meta)
        self.conn.start_load_kv()
        self.conn.wait_for_save()
        self.conn.clear_connector_metadata()

    def wait_recving(self, req_id: str) -> None:
        wait_for(lambda: req_id in (self.conn.get_finished(set())[1] or ()))

    def holds(self, block: int, source_block: int) -> bool:
        return all(
            torch.equal(c[:, block], s[:, source_block])
            for c, s in zip(self.caches, self.source, strict=True)
        )

    def is_zero(self, block: int) -> bool:
        return all(not c[:, block].any() for c in self.caches)


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker(DictStore())
    yield w
    w.conn.shutdown()


def test_async_load_lands_in_the_cache_and_is_reported(worker: Worker) -> None:
    """An async load runs on the transfer thread; get_finished reports the
    request once its blocks are in the cache (copied on the step thread)."""
    hashes = [block_hash(i) for i in range(3)]
    for h, src in zip(hashes, [1, 2, 3], strict=True):
        worker.store.frames[h] = worker.frame_of_source(src, h)
    dest = [9, 4, 12]
    worker.run_step(StoreConnectorMetadata(loads=[LoadSpec("r1", dest, hashes, is_async=True)]))
    worker.wait_recving("r1")
    for block, src in zip(dest, [1, 2, 3], strict=True):
        assert worker.holds(block, src)
    for block in set(range(NUM_CACHE_BLOCKS)) - set(dest):
        assert worker.is_zero(block)
    assert worker.conn.get_block_ids_with_load_errors() == set()
    # Reported once.
    assert worker.conn.get_finished(set()) == (None, None)
    assert worker.conn.take_stats() is None  # nothing failed


def test_sync_load_lands_before_the_forward(worker: Worker) -> None:
    """A sync load is in the cache when start_load_kv returns and is not
    reported through get_finished."""
    hashes = [block_hash(i) for i in range(2)]
    for h, src in zip(hashes, [5, 6], strict=True):
        worker.store.frames[h] = worker.frame_of_source(src, h)
    worker.conn.bind_connector_metadata(
        StoreConnectorMetadata(loads=[LoadSpec("r1", [2, 3], hashes, is_async=False)])
    )
    worker.conn.start_load_kv()
    assert worker.holds(2, 5) and worker.holds(3, 6)
    worker.conn.clear_connector_metadata()
    assert worker.conn.get_finished(set()) == (None, None)
    assert worker.conn.get_block_ids_with_load_errors() == set()


def corrupt_flip(frame: bytes, codec: BlockCodec) -> bytes:
    data = bytearray(frame)
    data[-10] ^= 0x40
    return bytes(data)


def corrupt_truncate(frame: bytes, codec: BlockCodec) -> bytes:
    return frame[:-8]


def corrupt_other_layout(frame: bytes, codec: BlockCodec) -> bytes:
    other = BlockCodec("another-model", LAYOUT)
    # Bound to the right key (the tests corrupt block 1): only the layout differs.
    return other.encode(frame[HEADER_BYTES:], block_hash(1))


def corrupt_garbage(frame: bytes, codec: BlockCodec) -> bytes:
    return b"not a frame"


CORRUPTIONS = [corrupt_flip, corrupt_truncate, corrupt_other_layout, corrupt_garbage]


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_bad_frame_is_a_load_error(
    worker: Worker, corrupt: Callable[[bytes, BlockCodec], bytes], is_async: bool
) -> None:
    """A frame that fails its checks is reported (once) as an invalid block
    and not written into the cache; the other blocks of the load, before and
    after it, still land."""
    hashes = [block_hash(i) for i in range(3)]
    for h, src in zip(hashes, [1, 2, 3], strict=True):
        worker.store.frames[h] = worker.frame_of_source(src, h)
    worker.store.frames[hashes[1]] = corrupt(worker.store.frames[hashes[1]], worker.codec)
    loads = [LoadSpec("r1", [7, 8, 9], hashes, is_async=is_async)]
    worker.run_step(StoreConnectorMetadata(loads=loads))
    if is_async:
        worker.wait_recving("r1")
    assert worker.conn.get_block_ids_with_load_errors() == {8}
    assert worker.conn.get_block_ids_with_load_errors() == set()
    assert worker.holds(7, 1) and worker.holds(9, 3)
    assert worker.is_zero(8)
    stats = worker.conn.take_stats()
    assert stats is not None and stats.failures == {TransferFailure.CORRUPT: 1}
    assert worker.conn.take_stats() is None  # reported once


def test_missing_block_is_a_load_error(worker: Worker) -> None:
    """A block evicted between lookup and load is an invalid block too."""
    hashes = [block_hash(i) for i in range(2)]
    worker.store.frames[hashes[0]] = worker.frame_of_source(1, hashes[0])
    worker.run_step(StoreConnectorMetadata(loads=[LoadSpec("r1", [3, 4], hashes, is_async=True)]))
    worker.wait_recving("r1")
    assert worker.conn.get_block_ids_with_load_errors() == {4}
    assert worker.holds(3, 1)
    stats = worker.conn.take_stats()
    assert stats is not None and stats.failures == {TransferFailure.MISSING: 1}


class DownStore(DictStore):
    """A store that cannot be reached: reads miss and say why, saves fail."""

    def read_into(self, hashes: Sequence[bytes], frames: np.ndarray) -> list[int]:
        self.last_error = "load failed: ConnectionError: refused"
        return [-1] * len(hashes)

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> bool:
        self.last_error = "save failed: ConnectionError: refused"
        return False


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
def test_a_store_that_is_down_counts_store_errors(is_async: bool) -> None:
    w = Worker(DownStore())
    try:
        hashes = [block_hash(i) for i in range(2)]
        w.run_step(StoreConnectorMetadata(loads=[LoadSpec("r1", [3, 4], hashes, is_async)]))
        if is_async:
            w.wait_recving("r1")
        assert w.conn.get_block_ids_with_load_errors() == {3, 4}
        stats = w.conn.take_stats()
        assert stats is not None and stats.failures == {TransferFailure.STORE_ERROR: 1}
        w.run_step(StoreConnectorMetadata(saves=[(5, block_hash(0)), (6, block_hash(1))]))
        stats = wait_for(w.conn.take_stats)
        assert stats.failures == {TransferFailure.SAVE_FAILED: 1}  # one batch
    finally:
        w.conn.shutdown()


def test_save_copies_out_and_frames_the_blocks(worker: Worker) -> None:
    """wait_for_save copies the listed blocks out of the cache at once (the
    scheduler may reuse them right after the step) and the transfer thread
    stores them as verified frames under their block hashes."""
    io = KVBlockIO(worker.caches)
    for layer, src in zip(worker.caches, worker.source, strict=True):
        layer.copy_(src)
    expected = {block_hash(0): bytes(io.gather([5])[0]), block_hash(1): bytes(io.gather([11])[0])}
    saves = [(5, block_hash(0)), (11, block_hash(1))]
    worker.run_step(StoreConnectorMetadata(saves=saves))
    for layer in worker.caches:
        layer.zero_()  # reused by the next step
    wait_for(lambda: len(worker.store.frames) == 2)
    for h, payload in expected.items():
        assert bytes(worker.codec.check(worker.store.frames[h], h)) == payload
    assert worker.store.puts == [block_hash(0), block_hash(1)]


def test_async_load_waits_for_the_producer() -> None:
    """A P/D load waits (up to load_wait_seconds) for blocks the producer
    has not written yet, and loads them once they appear."""
    w = Worker(DictStore(), load_wait_seconds=TIMEOUT)
    try:
        hashes = [block_hash(i) for i in range(2)]
        spec = LoadSpec("r1", [1, 2], hashes, is_async=True, wait_for_producer=True)
        w.run_step(StoreConnectorMetadata(loads=[spec]))
        time.sleep(0.05)
        assert w.conn.get_finished(set()) == (None, None)
        for h, src in zip(hashes, [3, 4], strict=True):
            w.store.frames[h] = w.frame_of_source(src, h)
        w.wait_recving("r1")
        assert w.conn.get_block_ids_with_load_errors() == set()
        assert w.holds(1, 3) and w.holds(2, 4)
    finally:
        w.conn.shutdown()


def test_async_load_gives_up_after_load_wait_seconds() -> None:
    """Blocks that never appear are reported as load errors after the wait,
    and what did arrive is used."""
    w = Worker(DictStore(), load_wait_seconds=0.1)
    try:
        hashes = [block_hash(i) for i in range(2)]
        w.store.frames[hashes[0]] = w.frame_of_source(6, hashes[0])
        spec = LoadSpec("r1", [1, 2], hashes, is_async=True, wait_for_producer=True)
        started = time.monotonic()
        w.run_step(StoreConnectorMetadata(loads=[spec]))
        w.wait_recving("r1")
        assert time.monotonic() - started >= 0.1
        assert w.conn.get_block_ids_with_load_errors() == {2}
        assert w.holds(1, 6)
    finally:
        w.conn.shutdown()


def test_a_dying_transfer_thread_shows_in_health(worker: Worker) -> None:
    """A store that raises (against its contract) kills the transfer thread;
    health() says so, so the service can report NOT_SERVING."""
    assert worker.conn.health() is None
    worker.store.fail_get = RuntimeError("boom")
    worker.store.frames[block_hash(0)] = worker.frame_of_source(0, block_hash(0))
    worker.run_step(
        StoreConnectorMetadata(loads=[LoadSpec("r1", [1], [block_hash(0)], is_async=True)])
    )
    problem = wait_for(worker.conn.health)
    assert "KV transfer thread died" in problem and "boom" in problem


def test_shutdown_closes_the_store() -> None:
    store = DictStore()
    w = Worker(store)
    w.conn.shutdown()
    assert store.closed


# ==== both halves, with a scheduler and a scripted model =======================


def run_engine(sched: Scheduler, worker: Worker, max_steps: int = 500) -> dict[str, list[int]]:
    """What EngineCore.step does, with the worker connector's hooks around a
    fake forward that samples token 7 for a request that caught up with its
    tokens. Returns each request's tokens; fails after ``max_steps``."""
    produced: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return produced
        so = sched.schedule()
        conn = worker.conn
        assert so.kv_connector_metadata is not None
        conn.bind_connector_metadata(so.kv_connector_metadata)
        conn.start_load_kv()
        req_ids = list(so.num_scheduled_tokens)
        sampled = [
            [7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
            for r in req_ids
        ]
        conn.wait_for_save()
        sending, recving = conn.get_finished(so.finished_req_ids)
        kv_output = KVConnectorOutput(sending, recving, conn.get_block_ids_with_load_errors())
        conn.clear_connector_metadata()
        output = ModelRunnerOutput(
            req_ids, {r: i for i, r in enumerate(req_ids)}, sampled, kv_connector_output=kv_output
        )
        for out in sched.update_from_output(so, output).outputs:
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
        time.sleep(0.001)  # as EngineCore polls transfers
    waiting = [(r.request_id, str(r.status)) for r in sched.waiting]
    raise AssertionError(f"requests did not finish in {max_steps} steps; waiting: {waiting}")


@pytest.mark.parametrize(
    ("load_async", "bad_block"),
    [
        (False, 0),
        (False, 2),
        (True, 2),
        (True, 0),
    ],
    ids=["sync-first", "sync-later", "async-later", "async-first"],
)
def test_request_with_a_bad_stored_block_still_finishes(load_async: bool, bad_block: int) -> None:
    """Four stored blocks of a prompt, one of them corrupt: the request loads
    what it can, recomputes the rest, and finishes with every block free."""
    store = DictStore()
    sched_conn = make_connector(store, load_async=load_async)
    worker = Worker(store, num_blocks=64, load_async=load_async)
    sched = make_scheduler(block_size=BS, num_blocks=64, connector=sched_conn)
    request = make_request("r1", prompt_of(4 * BS + 2), max_tokens=3)
    for i, h in enumerate(request.block_hashes):
        frame = worker.codec.encode(bytes(worker.codec.payload_bytes), h)
        store.frames[h] = corrupt_flip(frame, worker.codec) if i == bad_block else frame
    sched.add_request(request)
    try:
        produced = run_engine(sched, worker)
    finally:
        sched_conn.shutdown()
        worker.conn.shutdown()
    assert produced == {"r1": [7, 7, 7]}
    assert free_blocks(sched) == 63
    assert not sched.waiting and not sched.running


class SlowLoadStore(DictStore):
    """Loads wait for ``load_gate``: a transfer still running."""

    def __init__(self) -> None:
        super().__init__()
        self.load_gate = threading.Event()

    def read_into(self, hashes: Sequence[bytes], frames: np.ndarray) -> list[int]:
        assert self.load_gate.wait(TIMEOUT)
        return super().read_into(hashes, frames)


def test_abort_during_an_async_load_holds_the_blocks_until_it_ends() -> None:
    """A request aborted while its blocks load keeps them allocated until
    the transfer is over (finished_sending), so the load can never write
    into blocks another request got meanwhile; then every block is free."""
    store = SlowLoadStore()
    sched_conn = make_connector(store, load_async=True)
    worker = Worker(store, num_blocks=64, load_async=True)
    sched = make_scheduler(block_size=BS, num_blocks=64, connector=sched_conn)
    request = make_request("r1", prompt_of(4 * BS + 2), max_tokens=3)
    for h in request.block_hashes:
        store.frames[h] = worker.codec.encode(bytes(worker.codec.payload_bytes), h)
    sched.add_request(request)
    try:
        so = sched.schedule()  # admitted: the async load is issued
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert isinstance(so.kv_connector_metadata, StoreConnectorMetadata)
        worker.run_step(so.kv_connector_metadata)
        sched.update_from_output(so, ModelRunnerOutput([], {}, []))
        held = 63 - free_blocks(sched)
        assert held == 4
        sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
        assert 63 - free_blocks(sched) == held, "blocks freed while the load runs"
        store.load_gate.set()
        released: set[str] = set()
        for _ in range(500):
            so = sched.schedule()
            sending, recving = worker.conn.get_finished(so.finished_req_ids)
            assert not recving, "an aborted request's load reported as received"
            output = ModelRunnerOutput([], {}, [], kv_connector_output=KVConnectorOutput(sending))
            sched.update_from_output(so, output)
            released |= sending or set()
            if released:
                break
            time.sleep(0.005)
        assert released == {"r1"}
        assert free_blocks(sched) == 63
    finally:
        store.load_gate.set()
        sched_conn.shutdown()
        worker.conn.shutdown()


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_fail_policy_frees_every_block_of_the_failed_request(load_async: bool) -> None:
    """kv_load_failure_policy=fail with this connector: the request ends (no
    tokens) and, once its load is over, holds no block; none is held back
    waiting for a completion that was already reported."""
    store = DictStore()
    sched_conn = make_connector(store, load_async=load_async)
    worker = Worker(store, num_blocks=64, load_async=load_async)
    sched = make_scheduler(
        block_size=BS, num_blocks=64, connector=sched_conn, kv_load_failure_policy="fail"
    )
    request = make_request("r1", prompt_of(4 * BS + 2), max_tokens=3)
    for i, h in enumerate(request.block_hashes):
        frame = worker.codec.encode(bytes(worker.codec.payload_bytes), h)
        store.frames[h] = corrupt_flip(frame, worker.codec) if i == 0 else frame
    sched.add_request(request)
    try:
        produced = run_engine(sched, worker)
    finally:
        sched_conn.shutdown()
        worker.conn.shutdown()
    assert produced == {"r1": []}
    assert request.status == RequestStatus.FINISHED_ERROR
    assert free_blocks(sched) == 63
