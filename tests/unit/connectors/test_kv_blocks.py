"""KVBlockIO: whole KV blocks copied between per-layer paged caches
``[2, num_blocks, block_size, heads, head_dim]`` and per-block payloads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from connectors.block_codec import BlockCodec
from connectors.kv_blocks import KVBlockIO
from engine.kv_transfer.base import KVLayout
from kernels import cpu_kernels, kv_layout

NUM_LAYERS = 3
NUM_BLOCKS = 10
BLOCK_SIZE = 4
HEADS = 2
HEAD_DIM = 8
# int8: rows of HEAD_DIM values and their 4-byte scale (kernels/kv_int8.py),
# head-major in memory as the engine allocates them (kernels/kv_layout.py),
# moved as bytes like any block.
DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def make_caches(dtype: torch.dtype, *, random: bool, seed: int = 0) -> list[torch.Tensor]:
    row = HEAD_DIM + 4 if dtype == torch.int8 else HEAD_DIM
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, row)
    if not random:
        return [kv_layout.new_cache(shape, dtype, "cpu") for _ in range(NUM_LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return [
            kv_layout.as_head_major(torch.randint(-128, 128, shape, generator=gen, dtype=dtype))
            for _ in range(NUM_LAYERS)
        ]
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(NUM_LAYERS)]


def expected_payload(caches: list[torch.Tensor], block: int) -> bytes:
    """The documented payload: for each layer, K then V of the block, each
    its bytes as they lie in memory."""
    parts = [kv_layout.in_memory_order(cache)[kv, block] for cache in caches for kv in (0, 1)]
    return torch.stack(parts).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_then_scatter_reproduces_the_selected_blocks(dtype: torch.dtype) -> None:
    """Blocks gathered (in an unordered selection) and scattered into the same
    ids of a zeroed cache are bit-identical; every other block stays zero."""
    src = make_caches(dtype, random=True)
    dst = make_caches(dtype, random=False)
    ids = [7, 2, 5, 0]
    payloads = KVBlockIO(src).gather(ids)
    KVBlockIO(dst).scatter(ids, payloads)
    for layer_src, layer_dst in zip(src, dst, strict=True):
        for block in range(NUM_BLOCKS):
            if block in ids:
                assert torch.equal(layer_dst[:, block], layer_src[:, block]), block
            else:
                assert not layer_dst[:, block].any(), block


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_into_other_block_ids(dtype: torch.dtype) -> None:
    """A payload is position-free: block 8 of one engine lands in block 1 of
    another (as when a second engine loads a stored prefix)."""
    src = make_caches(dtype, random=True, seed=1)
    dst = make_caches(dtype, random=False)
    src_ids, dst_ids = [8, 3, 9], [1, 6, 4]
    KVBlockIO(dst).scatter(dst_ids, KVBlockIO(src).gather(src_ids))
    moved = dict(zip(dst_ids, src_ids, strict=True))
    for layer_src, layer_dst in zip(src, dst, strict=True):
        for block in range(NUM_BLOCKS):
            if block in moved:
                assert torch.equal(layer_dst[:, block], layer_src[:, moved[block]])
            else:
                assert not layer_dst[:, block].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_payload_layout_and_size(dtype: torch.dtype) -> None:
    """Each payload is [layer][K, V][block elements] in the cache dtype, of
    the size BlockCodec expects for the same layout."""
    caches = make_caches(dtype, random=True, seed=2)
    io = KVBlockIO(caches)
    ids = [4, 1]
    payloads = io.gather(ids)
    assert len(payloads) == len(ids)
    layout = KVLayout(NUM_LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, str(dtype).removeprefix("torch."))
    assert io.payload_bytes == BlockCodec("m", layout).payload_bytes
    for block, payload in zip(ids, payloads, strict=True):
        assert len(payload) == io.payload_bytes
        assert bytes(payload) == expected_payload(caches, block)


def test_gather_copies_out_of_the_cache() -> None:
    """Payloads are copies: the cache may be overwritten right after gather
    (the scheduler reuses the blocks) without changing what gets saved."""
    caches = make_caches(torch.float32, random=True, seed=3)
    payloads = KVBlockIO(caches).gather([3])
    before = bytes(payloads[0])
    for cache in caches:
        cache.fill_(123.0)
    assert bytes(payloads[0]) == before


def test_scatter_accepts_bytes_and_single_blocks() -> None:
    """Payloads that went through a store come back as bytes; one block at a
    time works the same as a batch."""
    src = make_caches(torch.bfloat16, random=True, seed=4)
    dst = make_caches(torch.bfloat16, random=False)
    src_io, dst_io = KVBlockIO(src), KVBlockIO(dst)
    for block in (6, 0, 9):
        dst_io.scatter([block], [bytes(p) for p in src_io.gather([block])])
    for layer_src, layer_dst in zip(src, dst, strict=True):
        assert torch.equal(layer_dst[:, [6, 0, 9]], layer_src[:, [6, 0, 9]])
        assert not layer_dst[:, [1, 2, 3, 4, 5, 7, 8]].any()


def test_scatter_overwrites_existing_contents() -> None:
    """Scattering replaces whatever the block held (a stale reused block)."""
    src = make_caches(torch.float32, random=True, seed=5)
    dst = make_caches(torch.float32, random=True, seed=6)
    untouched = [c.clone() for c in dst]
    KVBlockIO(dst).scatter([2], KVBlockIO(src).gather([2]))
    for layer_src, layer_dst, layer_old in zip(src, dst, untouched, strict=True):
        assert torch.equal(layer_dst[:, 2], layer_src[:, 2])
        keep = [b for b in range(NUM_BLOCKS) if b != 2]
        assert torch.equal(layer_dst[:, keep], layer_old[:, keep])


def test_payload_bytes_and_block_count() -> None:
    io = KVBlockIO(make_caches(torch.float32, random=False))
    assert io.num_blocks == NUM_BLOCKS
    assert io.payload_bytes == NUM_LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4
    assert io.block_shape == (NUM_LAYERS, 2, BLOCK_SIZE * HEADS * HEAD_DIM)


def test_no_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        KVBlockIO([])


def test_payload_is_little_endian_float32() -> None:
    """A float32 payload reads back with numpy as the cache's values (the
    store format is the in-memory format)."""
    caches = make_caches(torch.float32, random=True, seed=7)
    (payload,) = KVBlockIO(caches).gather([5])
    values = np.frombuffer(payload, dtype="<f4").reshape(NUM_LAYERS, 2, -1)
    for layer, cache in enumerate(caches):
        assert np.array_equal(values[layer, 0], cache[0, 5].flatten().numpy())
        assert np.array_equal(values[layer, 1], cache[1, 5].flatten().numpy())


def test_compiled_and_numpy_copies_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ block copy (kernels/csrc/kv_copy.cpp) and the numpy fallback
    produce the same frames, and both scatter them back exactly."""
    caches = [torch.randn(2, 9, 16, 3, 64) for _ in range(4)]
    ids = [7, 2, 5]
    compiled = KVBlockIO(caches)
    if compiled._compiled is None:
        pytest.skip("no C++ toolchain: only the numpy path exists here")
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    fallback = KVBlockIO(caches)
    assert fallback._compiled is None
    frames = compiled.gather_frames(ids, 32)
    np.testing.assert_array_equal(frames[:, 32:], fallback.gather_frames(ids, 32)[:, 32:])
    for use_compiled in (True, False):
        target = [torch.zeros_like(c) for c in caches]
        dst = KVBlockIO(target)
        if use_compiled:
            dst._compiled = compiled._compiled
        else:
            assert dst._compiled is None and dst._np_layers is not None
        dst.scatter_frames(ids, frames, 32)
        for src, got in zip(caches, target, strict=True):
            torch.testing.assert_close(got[:, ids], src[:, ids], rtol=0, atol=0)
            assert not got[:, [0, 1, 3, 4, 6, 8]].any()


def test_compiled_copy_rejects_a_block_outside_the_cache() -> None:
    io = KVBlockIO([torch.zeros(2, 4, 16, 1, 8)])
    if io._compiled is None:
        pytest.skip("no C++ toolchain")
    with pytest.raises(RuntimeError, match="block id 4 outside the cache"):
        io.gather_frames([1, 4], 0)
