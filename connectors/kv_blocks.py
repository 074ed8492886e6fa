"""Copying whole KV blocks between the paged cache and flat byte buffers.

The cache is one tensor per layer, ``[2, num_blocks, block_size, heads,
head_dim]``. A block's payload is every layer's K then V for that block,
``[num_layers, 2, block_size * heads * head_dim]``, contiguous: the unit a
store keeps under one key. Gather and scatter touch each layer once for a
whole batch of blocks, not once per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class KVBlockIO:
    def __init__(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("kv_caches: expected at least one layer's cache")
        first = kv_caches[0]
        self.num_blocks = first.shape[1]
        # Each layer as [2, num_blocks, elements of one block's K (or V)].
        self.layers = [c.view(2, self.num_blocks, -1) for c in kv_caches]
        self.dtype = first.dtype
        self.device = first.device
        self.block_shape = (len(kv_caches), 2, self.layers[0].shape[2])
        self.payload_bytes = int(np.prod(self.block_shape)) * first.element_size()

    def gather(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Copies of the blocks' KV, one payload per block (host memory)."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        staging = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype)
        for layer_idx, layer in enumerate(self.layers):
            staging[:, layer_idx] = layer.index_select(1, ids).transpose(0, 1)
        flat = staging.view(torch.uint8).reshape(len(block_ids), -1).numpy()
        return [memoryview(row) for row in flat]

    def scatter(self, block_ids: Sequence[int], payloads: Sequence[memoryview | bytes]) -> None:
        """Write payloads (as made by gather) into the blocks."""
        n = len(block_ids)
        raw = np.empty((n, self.payload_bytes), np.uint8)
        for i, payload in enumerate(payloads):
            raw[i] = np.frombuffer(payload, np.uint8)
        staging = torch.from_numpy(raw).view(self.dtype).view(n, *self.block_shape)
        staging = staging.to(self.device, non_blocking=True)
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer_idx, layer in enumerate(self.layers):
            layer[:, ids] = staging[:, layer_idx].transpose(0, 1)
