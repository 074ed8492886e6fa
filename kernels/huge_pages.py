"""Weights on transparent huge pages, so a decode step's stream of them runs
at the memory's speed.

A single-stream decode step reads every weight once. On 4 KiB pages the
CPU's prefetchers stop at each page's end and every page costs a TLB miss;
gathered into one buffer advised MADV_HUGEPAGE (2 MiB pages), the default
model decoded a single stream 1.07x (exact) and 1.10x (int8 activations)
faster (benchmarks/JOURNAL.md, "Huge pages and one tile at a time").
torch advises huge pages only when THP_MEM_ALLOC_ENABLE is set before its
first allocation, and then for every large tensor; this does it for the
weights alone, whenever they are loaded.

Where the OS has no MADV_HUGEPAGE (not Linux) or THP is off, the buffer is
ordinary memory: the same contents, only the speed differs.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE = 2 * 2**20
# Each tensor starts on a cache line, as the allocator would place it.
_ALIGN = 64


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of `nbytes`, starting on a 2 MiB boundary,
    its pages advised MADV_HUGEPAGE before they are first touched."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    # Anonymous maps are only page-aligned: ask for one huge page more and
    # start at the first 2 MiB boundary inside.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # A kernel built without THP refuses the advice: ordinary pages then.
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes]


def move_to_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Copy each contiguous CPU tensor into one huge-page buffer and point it
    there in place (Tensor.set_), so every holder of the tensor, C++ ones
    included, sees the new memory. Returns the bytes moved. Tensors listed
    twice (tied weights) move once. The buffer's pages are touched as they
    are filled and each old copy is freed as soon as its tensor has moved
    (when nothing else holds it), so the peak stays near one copy plus the
    largest tensor (measured: 1,000 MiB in 20 tensors, peak RSS +51 MiB)."""
    unique = list({id(t): t for t in tensors}.values())
    for t in unique:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"only contiguous CPU tensors move: got {t.device} {tuple(t.shape)}")
    offsets, total = [], 0
    for t in unique:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if total == 0:
        return 0
    buffer = huge_page_buffer(total)
    storage = buffer.untyped_storage()
    base = buffer.storage_offset()
    with torch.inference_mode():  # the loader's weights are inference tensors
        for t, offset in zip(unique, offsets, strict=True):
            start = (base + offset) // t.element_size()
            view = torch.empty(0, dtype=t.dtype).set_(storage, start, t.shape, t.stride())
            view.copy_(t)
            t.set_(storage, start, t.shape, t.stride())
    return total
