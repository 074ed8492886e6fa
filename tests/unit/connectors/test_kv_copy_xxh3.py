"""The compiled checksumming block copies (``KVBlockCopier``, through
``KVBlockIO.gather_rows_xxh3`` / ``scatter_rows_xxh3``) against the Python
path: the same bytes as the plain copies, the same checksums as the xxhash
package (so frames sealed either way verify either way), and a corrupt
payload never reaches the cache. Also ``FrameBuffers`` reuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from connectors.block_codec import HEADER_BYTES, BlockCodec, FrameError
from connectors.kv_blocks import FrameBuffers, KVBlockIO
from engine.kv_transfer.base import KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
NUM_BLOCKS = 9


def _caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=gen) for _ in range(LAYOUT.num_layers)]


def _io(caches: list[torch.Tensor]) -> KVBlockIO:
    io = KVBlockIO(caches)
    if not io.copies_rows:
        pytest.skip("no C++ toolchain: the compiled copies are not built")
    return io


@pytest.fixture
def codec() -> BlockCodec:
    return BlockCodec("test-model", LAYOUT)


@pytest.mark.parametrize("rows", [None, [4, 0, 2]])
def test_gather_checksums_match_xxhash_and_bytes_match_the_plain_gather(
    codec: BlockCodec, rows: list[int] | None
) -> None:
    io = _io(_caches(0))
    ids = [7, 1, 3]
    frames = np.zeros((5 if rows else 3, codec.frame_bytes), np.uint8)
    sums = io.gather_rows_xxh3(ids, frames, rows, HEADER_BYTES)
    plain = io.gather_frames(ids, HEADER_BYTES)
    for j, r in enumerate(rows or range(3)):
        payload = frames[r, HEADER_BYTES:]
        np.testing.assert_array_equal(payload, plain[j, HEADER_BYTES:])
        assert sums[j] == xxhash.xxh3_64_intdigest(payload.data)


def test_sealed_frames_verify_in_python(codec: BlockCodec) -> None:
    """Headers written from the compiled checksums pass BlockCodec.check."""
    io = _io(_caches(1))
    frames = np.zeros((2, codec.frame_bytes), np.uint8)
    keys = [b"key-a", b"key-b"]
    codec.seal(frames, keys, io.gather_rows_xxh3([2, 5], frames, None, HEADER_BYTES))
    for row, key in zip(frames, keys, strict=True):
        codec.check(row.data, key)
    sealed_in_python = frames.copy()
    codec.seal(sealed_in_python, keys)  # checksums computed by xxhash
    np.testing.assert_array_equal(sealed_in_python, frames)


def test_scatter_copies_matching_payloads_only(codec: BlockCodec) -> None:
    src, dst = _io(_caches(2)), _io([torch.zeros_like(c) for c in _caches(2)])
    frames = np.zeros((3, codec.frame_bytes), np.uint8)
    sums = src.gather_rows_xxh3([1, 2, 3], frames, None, HEADER_BYTES)
    frames[1, HEADER_BYTES + 100] ^= 0x40  # corrupt the second payload
    mismatched = dst.scatter_rows_xxh3([4, 5, 6], frames, [0, 1, 2], HEADER_BYTES, sums)
    assert mismatched == [1]
    for s, d in zip(src.layers, dst.layers, strict=True):
        torch.testing.assert_close(d[:, [4, 6]], s[:, [1, 3]], rtol=0, atol=0)
        assert not d[:, 5].any(), "a corrupt payload reached the cache"


def test_check_headers_flags_what_check_rejects(codec: BlockCodec) -> None:
    io = _io(_caches(3))
    frames = np.zeros((4, codec.frame_bytes), np.uint8)
    sums = io.gather_rows_xxh3([0, 1, 2, 3], frames, None, HEADER_BYTES)
    keys = [bytes([k]) * 32 for k in range(4)]
    codec.seal(frames, keys, sums)
    frames[1, :4] = np.frombuffer(b"XXXX", np.uint8)  # bad magic
    lengths = [codec.frame_bytes, codec.frame_bytes, codec.frame_bytes - 1, -1]
    stated = codec.check_headers(frames, range(4), lengths, keys)
    assert stated == [sums[0], None, None, None]
    with pytest.raises(FrameError, match="magic"):
        codec.check(frames[1].data, keys[1])
    assert "magic" in str(codec.header_error(frames[1].data, keys[1]))
    # Row 0 is sound only under its own key.
    assert codec.check_headers(frames, [0], lengths[:1], keys[1:2]) == [None]


def test_checks_reject_bad_rows_and_ids(codec: BlockCodec) -> None:
    io = _io(_caches(4))
    frames = np.zeros((2, codec.frame_bytes), np.uint8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        io.gather_rows_xxh3([NUM_BLOCKS], frames, [0], HEADER_BYTES)
    with pytest.raises(RuntimeError, match="outside the frames"):
        io.scatter_rows_xxh3([0], frames, [2], HEADER_BYTES, [0])
    with pytest.raises(RuntimeError, match="too short"):
        io.gather_rows_xxh3([0, 1], frames[:, :-1], None, HEADER_BYTES)


def test_frame_buffers_reuse_and_cap() -> None:
    buffers = FrameBuffers(row_bytes=16, max_retained_bytes=16 * 8)
    first = buffers.take(4)
    buffers.give_back(first)
    again = buffers.take(3)
    assert again.base is first or again.base is first.base  # reused, not reallocated
    assert again.shape == (3, 16)
    big = buffers.take(16)  # over the cap: not kept
    buffers.give_back(big)
    assert buffers.take(16).base is not big
    buffers.give_back(np.zeros((4, 16), np.uint8))  # not one of ours: ignored
    assert buffers.take(1).shape == (1, 16)
