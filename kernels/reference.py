"""Pure-torch reference versions of the paged-attention kernels.

Written for obviousness, not speed: one sequence at a time, K/V gathered
token by token through the block table. The Triton kernels and the fast CPU
path are tested against these.

Sliding window (Gemma 3's local layers, Mistral): with `sliding_window=w`
the new token at context position p attends to the positions k with
`p - w < k <= p` (at most w keys, itself included), exactly transformers'
sliding mask `kv_idx > q_idx - sliding_window`. `None` is the whole causal
context. Every backend validates the window with `check_sliding_window`.

An int8 cache (`kernels.kv_int8`: rows of int8 values and a float32 scale)
is written through the reference quantizer and, here only, read by
dequantizing the whole cache first: the kernels are tested against
attention over exactly those dequantized values.
"""

from __future__ import annotations

import torch

from kernels import kv_int8
from kernels.metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows `[num_tokens, num_kv_heads, head_dim]` into the paged
    cache `[2, num_blocks, block_size, num_kv_heads, head_dim]` at their slots
    (quantized rows `[..., head_dim + 4]` for an int8 cache)."""
    block_size = kv_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_cache[0, blocks, offsets] = kv_int8.cache_rows(key, kv_cache)
    kv_cache[1, blocks, offsets] = kv_int8.cache_rows(value, kv_cache)


def check_sliding_window(sliding_window: int | None) -> None:
    """Raises ValueError unless `sliding_window` is None or at least 1 (a
    window of 0 keys would leave a token nothing to attend to)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of `query` `[num_tokens, num_heads, head_dim]` over each
    sequence's cached context (its last `sliding_window` positions per token
    when given); returns `[num_tokens, num_heads, head_dim]`."""
    check_sliding_window(sliding_window)
    if kv_int8.is_int8_cache(kv_cache):
        kv_cache = kv_int8.dequantize_cache(kv_cache)
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]].float()  # [q_len, H, D]
        q_len = q.shape[0]
        positions = torch.arange(seq_len, device=query.device)
        blocks = meta.block_table[i, positions // block_size].long()
        k = kv_cache[0, blocks, positions % block_size].float()  # [seq_len, Hkv, D]
        v = kv_cache[1, blocks, positions % block_size].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        # New token j sits at context position seq_len - q_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = positions[None, :] > q_pos[:, None]
        if sliding_window is not None:
            mask |= positions[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
