"""The KV cache's tensors (engine/worker/kv_cache.py): zeroed, disjoint,
shaped, in their dtype's memory order (kernels/kv_layout.py)."""

from __future__ import annotations

import pytest
import torch

from engine.worker.kv_cache import KVCacheShape, allocate_kv_caches
from kernels import kv_layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_cpu_layers_are_zeroed_disjoint_and_shaped(dtype: torch.dtype) -> None:
    shape = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    caches = allocate_kv_caches(shape, num_blocks=5, device=torch.device("cpu"))
    assert len(caches) == 3
    for cache in caches:
        assert cache.shape == shape.layer_shape(5)
        assert cache.dtype == dtype
        # int8 caches are head-major in memory, the others token-major.
        assert cache.is_contiguous() == (dtype != torch.int8)
        assert kv_layout.in_memory_order(cache).is_contiguous()
        assert not cache.any()
        assert cache.data_ptr() % 64 == 0
    # Writing all of one layer leaves the others zero: no overlap.
    caches[1].fill_(7)
    assert not caches[0].any() and not caches[2].any()
    assert bool((caches[1] == 7).all())
    total = sum(c.numel() * c.element_size() for c in caches)
    assert total == 5 * shape.bytes_per_block


def test_layers_sharing_a_slot_share_a_tensor() -> None:
    shape = KVCacheShape(2, 1, 64, 16, torch.float32)
    caches = allocate_kv_caches(shape, 3, torch.device("cpu"), layer_slot=(0, 1, 0, 1))
    assert caches[0] is caches[2] and caches[1] is caches[3] and caches[0] is not caches[1]
