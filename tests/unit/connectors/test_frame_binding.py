"""A stored frame is bound to the key it was written under and to the
cache's layout facts (weight format included): a frame read under another
key (another prompt's valid frame written under the victim's key, or two
keys' frames swapped) is rejected, counted as corrupt, and never reaches the
cache, through every store path: the codec itself, Redis (a real
redis-server) and the shared-memory pool (staged and in place, sync and
async loads)."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from connectors.block_codec import HEADER_BYTES, MAGIC, BlockCodec, FrameError
from connectors.redis_connector import RedisConnector
from connectors.shm_connector import SharedMemoryConnector, ShmBlockStore
from connectors.store_connector import LoadSpec, StoreConnector, StoreConnectorMetadata
from engine.config import KVTransferConfig
from engine.kv_transfer.base import ConnectorContext, KVConnectorRole, KVLayout
from engine.stats import TransferFailure
from tests.integration.redis_server import REDIS_SERVER, RedisServer

LAYOUT = KVLayout(
    num_layers=2,
    num_kv_heads=2,
    head_dim=4,
    block_size=4,
    dtype="float32",
    weight_format="float32",
)
MODEL = "test-model"
NUM_BLOCKS = 8
TIMEOUT = 10.0


def block_hash(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


VICTIM, OTHER = block_hash("prompt about Tom"), block_hash("prompt about Bob")


def payload_for(codec: BlockCodec, seed: int) -> bytes:
    return bytes((seed + 7 * i) % 256 for i in range(codec.payload_bytes))


# ==== the codec ================================================================


def test_a_frame_read_under_another_key_is_rejected() -> None:
    """A valid frame checks out under its own key only; under another it
    names both keys' digests."""
    codec = BlockCodec(MODEL, LAYOUT)
    frame = codec.encode(payload_for(codec, 1), OTHER)
    assert bytes(codec.check(frame, OTHER)) == payload_for(codec, 1)
    with pytest.raises(FrameError, match="written for another block"):
        codec.check(frame, VICTIM)


def test_check_headers_rejects_frames_under_the_wrong_or_swapped_keys() -> None:
    """The batch header check (the compiled paths' only Python check) takes
    the keys the reader asked for: a swapped pair is two rejections."""
    codec = BlockCodec(MODEL, LAYOUT)
    frames = np.zeros((2, codec.frame_bytes), np.uint8)
    for row, seed in enumerate((3, 4)):
        frames[row, HEADER_BYTES:] = np.frombuffer(payload_for(codec, seed), np.uint8)
    codec.seal(frames, [VICTIM, OTHER])
    lengths = [codec.frame_bytes] * 2
    sound = codec.check_headers(frames, [0, 1], lengths, [VICTIM, OTHER])
    assert all(c is not None for c in sound)
    assert codec.check_headers(frames, [0, 1], lengths, [OTHER, VICTIM]) == [None, None]
    assert codec.check_headers(frames, [1], lengths[:1], [OTHER]) == sound[1:]


@pytest.mark.parametrize("offset", range(HEADER_BYTES))
def test_every_header_byte_is_covered(offset: int) -> None:
    """Any flipped header byte (the key and layout digests, the length, the
    payload checksum, the header checksum itself) rejects the frame."""
    codec = BlockCodec(MODEL, LAYOUT)
    frame = bytearray(codec.encode(payload_for(codec, 5), VICTIM))
    frame[offset] ^= 0x10
    with pytest.raises(FrameError):
        codec.check(bytes(frame), VICTIM)
    rows = np.frombuffer(bytes(frame), np.uint8).reshape(1, -1)
    assert codec.check_headers(rows, [0], [len(frame)], [VICTIM]) == [None]


def test_the_weight_format_is_part_of_the_namespace_and_the_frame() -> None:
    """Float32 weights and Q4_1 weights give different KV for the same
    tokens: different namespaces (so different keys) and frames that each
    codec refuses from the other."""
    f32 = BlockCodec(MODEL, LAYOUT)
    q4 = BlockCodec(MODEL, dataclasses.replace(LAYOUT, weight_format="q4_1+q8_0"))
    assert f32.namespace != q4.namespace
    assert f32.digest_key(VICTIM) != q4.digest_key(VICTIM)
    assert f32.text_key(VICTIM) != q4.text_key(VICTIM)
    with pytest.raises(FrameError, match="another model or layout"):
        q4.check(f32.encode(payload_for(f32, 6), VICTIM), VICTIM)
    with pytest.raises(FrameError, match="another model or layout"):
        f32.check(q4.encode(payload_for(q4, 6), VICTIM), VICTIM)


def test_a_frame_of_the_previous_version_is_refused_not_an_error() -> None:
    """A 32-byte-header frame (magic TKV1) is a FrameError (a miss to the
    store), never another exception; the magic and namespace moved on."""
    codec = BlockCodec(MODEL, LAYOUT)
    assert MAGIC != b"TKV1"
    payload = payload_for(codec, 7)
    old = struct.pack("<4sIQQ8s", b"TKV1", 0, len(payload), 0, b"\0" * 8) + payload
    with pytest.raises(FrameError):
        codec.check(old, VICTIM)


# ==== real stores, through the connector's worker half ============================


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if REDIS_SERVER is None:
        pytest.skip("needs redis-server")
    with RedisServer() as server:
        yield server.url


@dataclasses.dataclass
class Pod:
    """A worker-role store connector over a small real paged cache."""

    conn: StoreConnector
    caches: list[torch.Tensor]
    # Put ``frame`` where ``block_hash``'s frame is (in place).
    overwrite: Callable[[bytes, bytes], None]
    read: Callable[[bytes], bytes]

    def step(self, meta: StoreConnectorMetadata) -> None:
        self.conn.bind_connector_metadata(meta)
        self.conn.start_load_kv()
        self.conn.wait_for_save()
        self.conn.clear_connector_metadata()

    def is_zero(self, block: int) -> bool:
        return all(not c[:, block].any() for c in self.caches)


def _caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=gen) for _ in range(LAYOUT.num_layers)]


def _redis_pod(url: str) -> Pod:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    config = KVTransferConfig("redis", "kv_both", {"url": url, "key_prefix": prefix})
    conn = RedisConnector(KVConnectorRole.WORKER, ConnectorContext(config, MODEL, LAYOUT, "e"))
    store: Any = conn.store

    def overwrite(h: bytes, frame: bytes) -> None:
        store.client.set(store._key(h), frame)

    def read(h: bytes) -> bytes:
        value: bytes | None = store.client.get(store._key(h))
        assert value is not None
        return value

    return Pod(conn, _caches(), overwrite, read)


def _shm_pod() -> Pod:
    extra = {"pool_name": f"bind-{uuid.uuid4().hex[:8]}", "capacity_bytes": 1 << 20}
    config = KVTransferConfig("shm", "kv_both", extra)
    conn = SharedMemoryConnector(
        KVConnectorRole.WORKER, ConnectorContext(config, MODEL, LAYOUT, "e")
    )
    store = conn.store
    assert isinstance(store, ShmBlockStore)

    def overwrite(h: bytes, frame: bytes) -> None:
        def write(data: Any, indices: list[int], slots: list[int], lengths: list[int]) -> None:
            data[slots[0], : len(frame)] = np.frombuffer(frame, np.uint8)

        store.pool.read_with([store.codec.digest_key(h)], write)

    def read(h: bytes) -> bytes:
        (value,) = store.pool.get_many([store.codec.digest_key(h)])
        assert value is not None
        return value

    return Pod(conn, _caches(), overwrite, read)


@pytest.fixture(params=["redis", "shm"])
def pod(request: pytest.FixtureRequest) -> Iterator[Pod]:
    made = _redis_pod(request.getfixturevalue("redis_url")) if request.param == "redis" else None
    made = made or _shm_pod()
    made.conn.register_kv_caches({f"layer.{i}": c for i, c in enumerate(made.caches)})
    yield made
    made.conn.shutdown()


def _save(pod: Pod, saves: list[tuple[int, bytes]]) -> None:
    """Save blocks through the connector's own save path, and wait until
    the store holds them (a network store saves on the transfer thread)."""
    pod.step(StoreConnectorMetadata(saves=saves))
    hashes = [h for _, h in saves]
    deadline = time.monotonic() + TIMEOUT
    while not all(pod.conn.store.contains_many(hashes)):
        assert time.monotonic() < deadline, "the saves never landed"
        time.sleep(0.005)


def _load(pod: Pod, block_ids: list[int], hashes: list[bytes], is_async: bool) -> set[int]:
    """Load the blocks into zeroed cache blocks; the block ids that failed."""
    for c in pod.caches:
        c[:, block_ids] = 0
    pod.step(StoreConnectorMetadata(loads=[LoadSpec("r", block_ids, hashes, is_async)]))
    deadline = time.monotonic() + TIMEOUT
    while is_async and "r" not in (pod.conn.get_finished(set())[1] or ()):
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.002)
    return pod.conn.get_block_ids_with_load_errors()


def _failures(pod: Pod) -> dict[TransferFailure, int]:
    stats = pod.conn.take_stats()
    return dict(stats.failures) if stats is not None else {}


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_another_prompts_frame_under_the_victims_key_is_a_counted_miss(
    pod: Pod, is_async: bool
) -> None:
    """Another prompt's valid frame written under the victim's key: the
    victim's load rejects it (counted corrupt), the cache block keeps none
    of the other prompt's KV, and the scheduler is told to recompute it.
    The untouched block beside it still loads."""
    first = block_hash("shared first block")
    _save(pod, [(1, first), (2, VICTIM), (3, OTHER)])
    pod.overwrite(VICTIM, pod.read(OTHER))
    assert _load(pod, [5, 6], [first, VICTIM], is_async) == {6}
    assert pod.is_zero(6) and not pod.is_zero(5)
    assert _failures(pod) == {TransferFailure.CORRUPT: 1}
    # The frame under its own key is still good.
    assert _load(pod, [7], [OTHER], is_async) == set()
    assert torch.equal(pod.caches[0][:, 7], pod.caches[0][:, 3])


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_two_keys_frames_swapped_are_both_counted_misses(pod: Pod, is_async: bool) -> None:
    """Two keys' frames swapped in the store: both blocks fail, neither is
    written into the cache, and the load counts as corrupt."""
    _save(pod, [(1, VICTIM), (2, OTHER)])
    victims, others = pod.read(VICTIM), pod.read(OTHER)
    pod.overwrite(VICTIM, others)
    pod.overwrite(OTHER, victims)
    assert _load(pod, [5, 6], [VICTIM, OTHER], is_async) == {5, 6}
    assert pod.is_zero(5) and pod.is_zero(6)
    assert _failures(pod) == {TransferFailure.CORRUPT: 1}
