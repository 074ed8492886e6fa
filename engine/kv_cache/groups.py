"""KV cache groups: which layers share a block table.

A model whose layers all attend to the whole context has one group, and a
block id names one slot in every layer. A model with sliding-window layers
(Gemma 3: five local layers per global one) is split into groups of at most
``layers_per_group`` layers, each all-full or all-windowed, each with its own
block table: a windowed group's blocks are freed once they fall out of its
window while the full groups keep every block. So a long context costs the
windowed layers the window's KV only.

Every group spans the same number of layer slots, so a block id names the
same amount of memory in every group (vLLM's hybrid allocator does the
same): the cache is ``layers_per_group`` tensors, and layer ``l`` keeps its
KV in tensor ``layer_slot[l]`` at the block ids of group ``layer_group[l]``.
A group with fewer layers than slots leaves the rest unused (the cost of
uneven layer counts: Gemma 3 270M's 3 global + 15 local layers split evenly
into 1 + 5 groups of 3).

When the blocks must keep every layer's KV anyway (a KV connector saves and
loads whole blocks; a draft model shares the block table), ``single`` puts
every layer in one group whose window is None: windowed layers then read
only their window but their blocks live as long as the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window (None: full attention)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its cache tensor

    def __post_init__(self) -> None:
        if len(self.layer_group) != len(self.layer_slot):
            raise ValueError("layer_group and layer_slot must have one entry per layer")
        if self.layer_group and set(self.layer_group) != set(range(len(self.windows))):
            raise ValueError(f"every group needs a layer: {self.layer_group}")

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVCacheGroups:
        """Every layer in one group."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def plan(cls, layer_windows: tuple[int | None, ...], free_windowed: bool) -> KVCacheGroups:
        """Groups for layers with these windows. Without ``free_windowed``,
        one group that keeps every block."""
        n = len(layer_windows)
        kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
        if not free_windowed:
            return cls.single(n)
        if len(kinds) == 1:
            return cls.single(n, kinds[0])
        by_kind = [[i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds]
        size = min(len(layers) for layers in by_kind)
        windows: list[int | None] = []
        group = [0] * n
        slot = [0] * n
        for kind, layers in zip(kinds, by_kind, strict=True):
            for start in range(0, len(layers), size):
                for offset, layer in enumerate(layers[start : start + size]):
                    group[layer] = len(windows)
                    slot[layer] = offset
                windows.append(kind)
        return cls(tuple(windows), tuple(group), tuple(slot))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_group(self) -> int:
        """The cache's tensors: one per slot."""
        return max(self.layer_slot) + 1

    @property
    def frees_windowed(self) -> bool:
        return any(w is not None for w in self.windows)


def blocks_held(num_tokens: int, block_size: int, window: int | None, chunk: int) -> int:
    """The most blocks one group with this window holds for a request of
    ``num_tokens`` tokens, when a step computes at most ``chunk`` tokens
    (count rolled-back drafts in it)."""
    whole = ceil(num_tokens / block_size)
    if window is None:
        return whole
    # The window behind the chunk's first token, the chunk, and a partial
    # block at each end.
    return min(whole, ceil((window - 1 + chunk) / block_size) + 1)
