"""kernels.kv_layout: one shape for every cache, the memory order in the
strides; the compiled kernels refuse any other strides by name."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels, kv_layout
from kernels.huge_pages import HUGE_PAGE

SHAPE = (2, 5, 16, 3, 68)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_new_cache_is_zeroed_in_its_dtypes_order(dtype: torch.dtype) -> None:
    cache = kv_layout.new_cache(SHAPE, dtype, "cpu")
    assert cache.shape == SHAPE and cache.dtype == dtype and not cache.any()
    memory = kv_layout.in_memory_order(cache)
    assert memory.is_contiguous()
    if dtype == torch.int8:  # [2, blocks, heads, block_size, row] in memory
        assert memory.shape == (2, 5, 3, 16, 68)
        assert cache.stride() == (5 * 16 * 3 * 68, 16 * 3 * 68, 68, 16 * 68, 1)
    else:
        assert memory is cache


def test_a_cpu_cache_starts_on_a_huge_page_boundary() -> None:
    """On 2 MiB pages where the OS gives them (advised before first touch,
    so the pages come huge): the buffer starts on a 2 MiB boundary, and a
    write lands in the cache's own memory, read back through any view."""
    cache = kv_layout.new_cache(SHAPE, torch.bfloat16, "cpu")
    assert cache.data_ptr() % HUGE_PAGE == 0
    cache[1, 4, 15, 2, 67] = 3.0
    assert kv_layout.in_memory_order(cache).view(-1)[-1].item() == 3.0
    assert cache.sum().item() == 3.0


def test_a_head_major_block_is_each_heads_rows_in_a_run() -> None:
    cache = kv_layout.new_cache(SHAPE, torch.int8, "cpu")
    cache[1, 2, 5, 1] = 7  # V, block 2, token 5, head 1
    flat = kv_layout.in_memory_order(cache).view(2, 5, -1)
    start = (1 * 16 + 5) * 68  # head 1's run, then token 5's row in it
    assert flat[1, 2, start : start + 68].eq(7).all()
    assert int(flat.ne(0).sum()) == 68


def test_as_head_major_keeps_the_values() -> None:
    x = torch.randint(-127, 128, SHAPE, dtype=torch.int8)
    y = kv_layout.as_head_major(x)
    assert torch.equal(x, y) and not y.is_contiguous() and kv_layout.is_kernel_layout(y)


def test_other_strides_are_refused() -> None:
    odd = torch.zeros(2, 16, 5, 3, 68, dtype=torch.int8).transpose(1, 2)  # blocks not units
    assert not kv_layout.is_kernel_layout(odd)
    with pytest.raises(ValueError, match="token- or head-major"):
        kv_layout.in_memory_order(odd)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="compiled CPU kernels unavailable")
def test_the_compiled_kernels_refuse_other_strides_by_name() -> None:
    kernel = cpu_kernels.load()
    assert kernel is not None
    odd = torch.zeros(2, 16, 5, 3, 68, dtype=torch.int8).transpose(1, 2)
    query, out = torch.zeros(1, 3, 64), torch.zeros(1, 3, 64)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="decode_attention: kv_cache must be token- or head"):
        kernel.decode_attention(out, query, odd, table, lens, 0.125, 0)
    key = torch.zeros(1, 3, 64)
    with pytest.raises(RuntimeError, match="int8 KV write: kv_cache must be token- or head"):
        kernel.cache_kv_int8(odd, key, key, torch.zeros(1, dtype=torch.int64))
