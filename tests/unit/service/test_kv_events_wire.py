"""vLLM's KV-event payloads: the bytes vLLM 0.12 writes, decoded the way its
consumers decode them (a msgpack array per struct, the tag first)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import pytest

from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from service.kv_events_wire import (
    END_OF_REPLAY,
    encode_batch,
    fold_block_hash,
    sequence_frame,
)

H = [hashlib.sha256(bytes([i])).digest() for i in range(4)]

# msgspec's encoding of vLLM 0.12's KVEventBatch(ts=1712345678.123456,
# events=[BlockStored(<H2, H3 folded>, <H1 folded>, [70000, 5, 2**31, 300],
# 16, None, "GPU"), BlockRemoved([<H0 folded>], "GPU"), AllBlocksCleared()],
# data_parallel_rank=0): vLLM's own structs run through msgspec once, offline.
VLLM_BYTES = bytes.fromhex(
    "93cb41d984149387e6b49397ab426c6f636b53746f72656492cf4b76ea986457d986cf11b65a"
    "9aadff29c5cfd7cce23c7785459a94ce0001117005ce80000000cd012c10c0a347505593ac42"
    "6c6f636b52656d6f76656491cf8511a30617afa01da347505591b0416c6c426c6f636b73436c"
    "656172656400"
)


def decode(payload: bytes) -> tuple[float, list[list[Any]], int]:
    """What a vLLM consumer reads: [ts, [event...], data_parallel_rank]."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3
    ts, events, rank = batch
    return ts, events, rank


def test_the_bytes_are_vllms() -> None:
    events: list[KVCacheEvent] = [
        BlockStored(H[2:], H[1], [70000, 5, 2**31, 300], 16),
        BlockRemoved([H[0]]),
        AllBlocksCleared(),
    ]
    assert encode_batch(events, 1712345678.123456) == VLLM_BYTES


def test_block_stored_round_trip() -> None:
    tokens = list(range(100, 132))
    ts, events, rank = decode(encode_batch([BlockStored(H[:2], None, tokens, 16)], 12.25))
    assert (ts, rank) == (12.25, 0)
    [event] = events
    tag, hashes, parent, token_ids, block_size, lora_id, medium = event
    assert tag == "BlockStored"
    assert hashes == [fold_block_hash(H[0]), fold_block_hash(H[1])]
    assert parent is None
    assert token_ids == tokens
    assert (block_size, lora_id, medium) == (16, None, "GPU")


def test_block_stored_with_a_parent() -> None:
    _, [event], _ = decode(encode_batch([BlockStored([H[2]], H[1], [1] * 16, 16)], 0.0))
    assert event[2] == fold_block_hash(H[1])


def test_block_removed_round_trip() -> None:
    _, [event], _ = decode(encode_batch([BlockRemoved([H[3], H[0]])], 1.0))
    assert event == ["BlockRemoved", [fold_block_hash(H[3]), fold_block_hash(H[0])], "GPU"]


def test_all_blocks_cleared_round_trip() -> None:
    _, events, _ = decode(encode_batch([AllBlocksCleared(), AllBlocksCleared()], 1.0))
    assert events == [["AllBlocksCleared"], ["AllBlocksCleared"]]


def test_timestamp_is_a_float64_even_when_whole() -> None:
    payload = encode_batch([], 7)
    assert payload[1] == 0xCB  # msgpack float 64, as msgspec writes a float field
    assert decode(payload)[0] == 7.0


def test_fold_keeps_the_low_64_bits_big_endian() -> None:
    # vLLM: int.from_bytes(hash, "big") & (2**64 - 1)
    assert fold_block_hash(bytes(range(32))) == 0x18191A1B1C1D1E1F
    assert fold_block_hash(b"\xff" * 32) == 2**64 - 1
    assert fold_block_hash(bytes(24) + b"\x00" * 7 + b"\x01") == 1
    assert fold_block_hash(hashlib.sha256(b"\x00").digest()) == 0x8511A30617AFA01D


def test_a_folded_hash_above_2_63_is_a_uint64() -> None:
    _, [event], _ = decode(encode_batch([BlockRemoved([b"\xff" * 32])], 0.0))
    assert event[1] == [2**64 - 1]


def test_sequence_frames() -> None:
    assert sequence_frame(0) == bytes(8)
    assert sequence_frame(258) == b"\x00" * 6 + b"\x01\x02"
    assert int.from_bytes(END_OF_REPLAY, "big", signed=True) == -1


def test_a_foreign_event_is_refused() -> None:
    with pytest.raises(TypeError, match="not a KV cache event"):
        encode_batch(["stored"], 0.0)  # type: ignore[list-item]
