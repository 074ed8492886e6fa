"""BlockCodec: how a KV block is named (namespace, keys) and framed (header
with checksum + payload), and every way a stored frame is rejected."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Any

import pytest
import xxhash

from connectors.block_codec import HEADER_BYTES, MAGIC, BlockCodec, FrameError
from engine.kv_transfer.base import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
MODEL = "SmolLM2-135M-Instruct"
BLOCK_HASH = hashlib.sha256(b"block-0").digest()

# Values for MODEL / LAYOUT / BLOCK_HASH above. If these change, every stored
# block in every deployed store becomes unreachable: bump deliberately. Last
# bumped for frame version 2 (headers bound to their key; the weight format
# in the namespace), whose frames older releases must not find.
PINNED_NAMESPACE = "3e9b68235291be64"
PINNED_DIGEST_KEY = "117f0dacb2b706286ad166d836b56e3b5d503c29ff3f6e171a7e4fb57c4e0b8c"


def make_codec(model: str = MODEL, layout: KVLayout = LAYOUT) -> BlockCodec:
    return BlockCodec(model, layout)


def payload_for(codec: BlockCodec, seed: int = 0) -> bytes:
    return bytes((seed + 7 * i) % 256 for i in range(codec.payload_bytes))


def test_header_is_64_bytes_and_payload_size_follows_layout() -> None:
    """The header is 64 bytes (payloads stay aligned); the payload is K and
    V of every layer of one block in the cache dtype, and a frame is header
    + payload."""
    assert HEADER_BYTES == 64
    codec = make_codec()
    # 2 (K, V) * 2 layers * 4 tokens * 2 heads * 4 dims * 4 bytes
    assert codec.payload_bytes == 2 * 2 * 4 * 2 * 4 * 4
    assert codec.frame_bytes == HEADER_BYTES + codec.payload_bytes
    bf16 = make_codec(layout=dataclasses.replace(LAYOUT, dtype="bfloat16"))
    assert bf16.payload_bytes == codec.payload_bytes // 2
    # int8: each row's 4 values and its float32 scale (kernels/kv_int8.py).
    int8 = make_codec(layout=dataclasses.replace(LAYOUT, dtype="int8"))
    assert int8.payload_bytes == 2 * 2 * 4 * 2 * (4 + 4)


@pytest.mark.parametrize("as_view", [False, True])
def test_frame_roundtrip(as_view: bool) -> None:
    """encode() then check() gives back the payload, from bytes or a memoryview."""
    codec = make_codec()
    payload = payload_for(codec)
    frame = codec.encode(memoryview(payload) if as_view else payload, BLOCK_HASH)
    assert len(frame) == codec.frame_bytes
    assert frame[:4] == MAGIC
    assert frame[HEADER_BYTES:] == payload
    assert bytes(codec.check(frame, BLOCK_HASH)) == payload
    # A second codec for the same model and layout (another pod) reads it too.
    assert bytes(make_codec().check(memoryview(frame), BLOCK_HASH)) == payload


@pytest.mark.parametrize("keep", [0, 1, HEADER_BYTES - 1])
def test_frame_shorter_than_header_is_rejected(keep: int) -> None:
    """A frame cut inside its header says it is shorter than its header."""
    codec = make_codec()
    frame = codec.encode(payload_for(codec), BLOCK_HASH)
    with pytest.raises(FrameError, match="shorter than its header"):
        codec.check(frame[:keep], BLOCK_HASH)


@pytest.mark.parametrize("cut", [1, 64])
def test_truncated_frame_is_rejected(cut: int) -> None:
    """A frame missing the end of its payload names the sizes involved."""
    codec = make_codec()
    frame = codec.encode(payload_for(codec), BLOCK_HASH)
    have = codec.payload_bytes - cut
    with pytest.raises(
        FrameError, match=f"holds {have} payload bytes.*needs {codec.payload_bytes}"
    ):
        codec.check(frame[:-cut], BLOCK_HASH)


def test_extended_frame_is_rejected() -> None:
    """Trailing bytes after the payload make the frame invalid."""
    codec = make_codec()
    frame = codec.encode(payload_for(codec), BLOCK_HASH)
    have = codec.payload_bytes + 1
    with pytest.raises(FrameError, match=f"holds {have} payload bytes"):
        codec.check(frame + b"\x00", BLOCK_HASH)


def test_header_length_disagreeing_with_layout_is_rejected() -> None:
    """A self-consistent frame (header length == bytes present) whose payload
    size is not the layout's is still rejected."""
    codec = make_codec()
    short = codec.encode(payload_for(codec)[:-4], BLOCK_HASH)
    with pytest.raises(FrameError, match="header says"):
        codec.check(short, BLOCK_HASH)


def test_wrong_magic_is_rejected() -> None:
    codec = make_codec()
    frame = bytearray(codec.encode(payload_for(codec), BLOCK_HASH))
    frame[:4] = b"XKV1"
    with pytest.raises(FrameError, match="bad magic b'XKV1'"):
        codec.check(bytes(frame), BLOCK_HASH)


@pytest.mark.parametrize("offset", [0, 1, 100, -1])
def test_flipped_payload_byte_fails_the_checksum(offset: int) -> None:
    """Any single flipped payload byte is caught by the checksum."""
    codec = make_codec()
    frame = bytearray(codec.encode(payload_for(codec), BLOCK_HASH))
    index = HEADER_BYTES + offset if offset >= 0 else len(frame) + offset
    frame[index] ^= 0x01
    with pytest.raises(FrameError, match="checksum mismatch"):
        codec.check(bytes(frame), BLOCK_HASH)


def test_corrupted_checksum_field_is_rejected() -> None:
    codec = make_codec()
    frame = bytearray(codec.encode(payload_for(codec), BLOCK_HASH))
    frame[16] ^= 0xFF  # inside the payload checksum field (after magic, flags, length)
    with pytest.raises(FrameError, match="checksum mismatch"):
        codec.check(bytes(frame), BLOCK_HASH)


@pytest.mark.parametrize(
    "other",
    [
        make_codec(model="another-model"),
        make_codec(layout=dataclasses.replace(LAYOUT, block_size=8)),
        make_codec(layout=dataclasses.replace(LAYOUT, num_kv_heads=4)),
        # Same payload size, different layout: only the layout digest tells.
        make_codec(layout=dataclasses.replace(LAYOUT, num_kv_heads=4, head_dim=2)),
        make_codec(layout=dataclasses.replace(LAYOUT, dtype="bfloat16")),
        make_codec(layout=dataclasses.replace(LAYOUT, dtype="float16")),
        make_codec(layout=dataclasses.replace(LAYOUT, dtype="int8")),
        # Same payload size and shape: KV computed under other weights.
        make_codec(layout=dataclasses.replace(LAYOUT, weight_format="q4_1+q8_0")),
    ],
    ids=[
        "model",
        "block_size",
        "heads",
        "same-size",
        "bfloat16",
        "float16",
        "int8",
        "weight_format",
    ],
)
def test_frame_from_another_model_or_layout_is_rejected(other: BlockCodec) -> None:
    """A frame written for another model or layout is refused by this codec
    and vice versa, even when the payload sizes happen to match."""
    codec = make_codec()
    mine = codec.encode(payload_for(codec), BLOCK_HASH)
    theirs = other.encode(payload_for(other), BLOCK_HASH)
    with pytest.raises(FrameError, match="another model or layout"):
        other.check(mine, BLOCK_HASH)
    with pytest.raises(FrameError, match="another model or layout"):
        codec.check(theirs, BLOCK_HASH)


def test_frame_error_is_a_value_error() -> None:
    assert issubclass(FrameError, ValueError)


LAYOUT_VARIANTS: dict[str, Any] = {
    "num_layers": 3,
    "num_kv_heads": 1,
    "head_dim": 8,
    "block_size": 16,
    "dtype": "bfloat16",
    "weight_format": "q4_1+q8_0",
}


@pytest.mark.parametrize("field", sorted(LAYOUT_VARIANTS))
def test_namespace_differs_by_each_layout_field(field: str) -> None:
    """Changing any one layout field changes the namespace (and so every key)."""
    base = make_codec()
    changed = make_codec(layout=dataclasses.replace(LAYOUT, **{field: LAYOUT_VARIANTS[field]}))
    assert changed.namespace != base.namespace
    assert changed.digest_key(BLOCK_HASH) != base.digest_key(BLOCK_HASH)
    assert changed.text_key(BLOCK_HASH) != base.text_key(BLOCK_HASH)


def test_namespace_differs_by_model_name_and_dtype() -> None:
    base = make_codec()
    assert make_codec(model="SmolLM2-360M-Instruct").namespace != base.namespace
    dtypes = {
        make_codec(layout=dataclasses.replace(LAYOUT, dtype=d)).namespace
        for d in ("float32", "bfloat16", "float16")
    }
    assert len(dtypes) == 3


def test_namespace_is_short_hex_and_equal_for_equal_inputs() -> None:
    ns = make_codec().namespace
    assert len(ns) == 16
    int(ns, 16)
    assert make_codec(layout=dataclasses.replace(LAYOUT)).namespace == ns


def test_digest_key_is_32_bytes_and_stable() -> None:
    """The fixed-size key is 32 bytes, depends on the block hash, and is the
    same in every process and release (pinned: pods share stores)."""
    codec = make_codec()
    key = codec.digest_key(BLOCK_HASH)
    assert isinstance(key, bytes)
    assert len(key) == 32
    assert make_codec().digest_key(BLOCK_HASH) == key
    assert codec.digest_key(hashlib.sha256(b"block-1").digest()) != key
    assert codec.namespace == PINNED_NAMESPACE
    assert key.hex() == PINNED_DIGEST_KEY


def test_text_key_is_readable() -> None:
    """Redis keys: prefix, 'kv', namespace, hex block hash."""
    codec = make_codec()
    assert codec.text_key(BLOCK_HASH) == f"kv:{codec.namespace}:{BLOCK_HASH.hex()}"
    assert (
        codec.text_key(BLOCK_HASH, "tandem:") == f"tandem:kv:{codec.namespace}:{BLOCK_HASH.hex()}"
    )


def test_header_fields() -> None:
    """The header holds magic, flags, payload length, payload checksum, a
    16-byte layout digest starting with the namespace, the key digest, and
    the checksum of all that."""
    codec = make_codec()
    payload = payload_for(codec)
    header = codec.header(payload, BLOCK_HASH)
    magic, flags, length, checksum, layout, key, seal = struct.unpack("<4sIQQ16s16sQ", header)
    assert (magic, flags, length) == (MAGIC, 0, len(payload))
    assert checksum == xxhash.xxh3_64_intdigest(payload)
    assert layout[:8] == bytes.fromhex(codec.namespace)
    assert key == xxhash.xxh3_128_digest(BLOCK_HASH)
    assert seal == xxhash.xxh3_64_intdigest(header[:56])
