"""Paged-attention kernels and how a model picks them.

Two ops, one signature each across every implementation:

* `reshape_and_cache(key, value, kv_cache, slot_mapping)` writes the step's
  new K/V rows into the paged cache;
* `paged_attention(query, kv_cache, meta, scale, sliding_window=None)`
  attends each new token causally over its sequence's cached context, or
  its last `sliding_window` positions (mixed prefill/decode batches,
  grouped-query heads; a windowed layer reads only the blocks in its window).

Implementations: `kernels.triton_attention` (GPU, and CPU under Triton's
interpreter), `kernels.torch_attention` (the fast CPU default) and
`kernels.reference` (slow, obviously correct, for tests). `select_backend`
picks one; `AttentionMetadata` describes the batch layout they share.
"""

from kernels.backend import AttentionBackend, select_backend
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]
