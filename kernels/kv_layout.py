"""How a KV cache tensor lies in memory: token-major or head-major blocks.

Every layer's cache has the same *shape*, ``[2, num_blocks, block_size,
num_kv_heads, row]`` (K at 0, V at 1; ``row`` is ``head_dim``, or
``head_dim + 4`` for int8: ``kernels.kv_int8``), so ``cache[kv, block,
slot, head]`` names the same row whatever the memory order. The order is
in the strides:

* **token-major** (float32, bfloat16, fp8): the tensor is contiguous; a
  token's heads lie side by side.
* **head-major** (int8): memory is ``[2, num_blocks, num_kv_heads,
  block_size, row]`` and the cache is its ``transpose(2, 3)`` view. A KV
  head's rows of a block are one run of ``block_size * row`` bytes (1,088
  for head_dim 64 and 16-token blocks: 17 whole cache lines). The decode
  kernel's work is one (sequence, KV head); with 68-byte rows token-major,
  each row it read straddled two lines shared with the other heads' rows,
  and int8 decode ran at 0.90x bfloat16's speed; head-major, with integer
  arithmetic, 1.31x (benchmarks/README.md, kv_int8_bench.py).

Either way a block is one contiguous unit (``block_size * num_kv_heads *
row`` elements, K's and V's blocks apart), so connectors that move whole
blocks move bytes and need not know the order, as long as the receiving
cache has the same order (block keys include the cache dtype, and the
order follows from the dtype). The compiled CPU kernels read the order
from the strides (``kernels/csrc/kv_layout.h``); torch code indexes the
cache by its shape and gets either for free. Code that needs the flat
bytes (``view``) takes ``in_memory_order(cache)``.
"""

from __future__ import annotations

import torch

from kernels.huge_pages import huge_page_buffer


def head_major(dtype: torch.dtype) -> bool:
    """Whether caches of `dtype` are allocated head-major (see above)."""
    return dtype == torch.int8


def new_cache(
    shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed cache of `shape` ``[2, blocks, block_size, heads, row]`` in
    `dtype`'s memory order. On CPU its pages are 2 MiB ones where the OS
    gives them (kernels/huge_pages.py): a decode step reads a few KB from
    each of thousands of scattered blocks, and on 4 KiB pages nearly every
    block cost a TLB miss (decode attention over serving-size caches ran
    1.26x faster on huge pages on an Intel Xeon in a VM: benchmarks/README.md,
    "amx_mlp_bench.py, cpu_attention_bench.py"; 1.10x on an AMD EPYC:
    benchmarks/JOURNAL.md)."""
    kv, blocks, block_size, heads, row = shape
    order = (kv, blocks, heads, block_size, row) if head_major(dtype) else shape
    if torch.device(device).type == "cpu":
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = kv * blocks * heads * block_size * row * itemsize
        memory = huge_page_buffer(nbytes).view(dtype).view(order)  # zeroed by the OS
    else:
        memory = torch.zeros(order, dtype=dtype, device=device)
    return memory.transpose(2, 3) if head_major(dtype) else memory


def _memory(cache: torch.Tensor) -> torch.Tensor | None:
    if cache.is_contiguous():
        return cache
    if cache.dim() != 5:
        return None
    memory = cache.transpose(2, 3)
    return memory if memory.is_contiguous() else None


def in_memory_order(cache: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor over the cache's memory: the cache itself
    (token-major) or its ``[2, blocks, heads, block_size, row]`` view
    (head-major). Raises ValueError for any other strides."""
    memory = _memory(cache)
    if memory is None:
        raise ValueError(
            f"a KV cache must be token- or head-major [2, blocks, block_size, heads, row]; "
            f"got shape {tuple(cache.shape)} with strides {cache.stride()}"
        )
    return memory


def is_kernel_layout(cache: torch.Tensor) -> bool:
    """Whether the compiled kernels can read `cache` in place (checked per
    layer and step: no exception on the way)."""
    return _memory(cache) is not None


def as_head_major(cache: torch.Tensor) -> torch.Tensor:
    """A head-major copy of `cache` (tests and benchmarks: the engine
    allocates its caches in order with `new_cache`)."""
    return cache.transpose(2, 3).contiguous().transpose(2, 3)
