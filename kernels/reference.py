"""Pure-torch reference versions of the paged-attention kernels.

Written for obviousness, not speed: one sequence at a time, K/V gathered
token by token through the block table. The Triton kernels and the fast CPU
path are tested against these.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows `[num_tokens, num_kv_heads, head_dim]` into the paged
    cache `[2, num_blocks, block_size, num_kv_heads, head_dim]` at their slots."""
    block_size = kv_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_cache[0, blocks, offsets] = key.to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value.to(kv_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of `query` `[num_tokens, num_heads, head_dim]` over each
    sequence's cached context; returns `[num_tokens, num_heads, head_dim]`."""
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
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
