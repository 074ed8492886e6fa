"""KV-cache tensors: how many blocks a memory budget holds, and allocating them.

One tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K at index 0, V at 1), so a block id names the same slot in every layer;
with several KV cache groups (``engine.kv_cache.groups``), one tensor per
slot of a group, shared by the layers in that slot of every group (each
group's blocks are its own, so they never meet).
An int8 cache's rows are ``head_dim + 4`` bytes, the row's float32 scale
last (``kernels.kv_int8``): a block holds its scales, and the budget counts
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError
from kernels.kv_int8 import int8_row_bytes
from kernels.kv_layout import new_cache


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int  # the cache's tensors: layers, or layers per KV cache group
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def row_elems(self) -> int:
        """Elements of one (token, head) row: head_dim, or head_dim + 4 bytes
        for int8 (its values, then its float32 scale)."""
        if self.dtype == torch.int8:
            return int8_row_bytes(self.head_dim)
        return self.head_dim

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """One layer's cache tensor shape."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.row_elems)

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.block_size * self.num_kv_heads * self.row_elems * itemsize
        return per_layer * self.num_layers


def kv_cache_budget(
    device: torch.device, kv_cache_memory: int | None, gpu_memory_utilization: float
) -> int:
    """Bytes the KV cache may take. Call after the weights are loaded, so a
    CUDA budget counts only what they left free."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    # Leave (1 - utilization) of the whole card for activations and others.
    return int(free - (1.0 - gpu_memory_utilization) * total)


def num_blocks_for_budget(shape: KVCacheShape, budget_bytes: int) -> int:
    num_blocks = budget_bytes // shape.bytes_per_block
    if num_blocks < 2:
        raise ConfigError(
            f"kv_cache_memory={budget_bytes!r} is invalid: expected at least two blocks' worth "
            f"({2 * shape.bytes_per_block} bytes for this model and block_size)"
        )
    return int(num_blocks)


def allocate_kv_caches(
    shape: KVCacheShape,
    num_blocks: int,
    device: torch.device,
    layer_slot: tuple[int, ...] | None = None,
) -> list[torch.Tensor]:
    """Each layer's cache tensor: ``shape.num_layers`` tensors, layer ``l``
    getting tensor ``layer_slot[l]`` (None: one tensor per layer)."""
    # Zeroed, not empty: the null block and padded reads must be finite.
    # (An int8 cache's zero rows have scale 0.0: they read as zeros.)
    # int8 caches are head-major in memory (kernels/kv_layout.py).
    tensors = [
        new_cache(shape.layer_shape(num_blocks), shape.dtype, device)
        for _ in range(shape.num_layers)
    ]
    if layer_slot is None:
        return tensors
    return [tensors[slot] for slot in layer_slot]
