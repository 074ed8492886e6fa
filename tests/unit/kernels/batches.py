"""Random paged batches for the attention tests (a helper, not a test module).

A batch is described by each sequence's query length and context length
(including the new tokens). Blocks are handed out from a shuffled pool so
that no sequence's blocks are contiguous or in order, and each sequence's
K/V is also kept contiguous (`contexts`) for dense comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class Shape:
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def label(self) -> str:
        kind = "decode" if max(self.q_lens) == 1 else "mixed"
        return (
            f"{kind}-s{len(self.q_lens)}-h{self.num_heads}/{self.num_kv_heads}"
            f"-d{self.head_dim}-b{self.block_size}"
        )


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata
    # Per sequence: (K, V), each [seq_len, num_kv_heads, head_dim], float32.
    contexts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


# Shapes shared by the torch and Triton tests: block sizes 16 and 32, head
# dims 64 and 128, GQA ratios 1, 3 and 8, ragged lengths (block-aligned,
# partial last block, single token), decodes with prefill chunks over a
# cached prefix and a fresh prefill in one batch.
SHAPES = (
    Shape((1, 1, 1, 1), (1, 16, 17, 45), 2, 2, 64, 16),
    Shape((1, 1, 1), (32, 5, 70), 6, 2, 128, 32),
    Shape((1, 1, 1), (9, 33, 64), 8, 1, 64, 16),
    Shape((1, 9, 1, 24, 1), (40, 30, 3, 24, 16), 6, 2, 64, 16),
    Shape((5, 1, 20, 1), (37, 50, 20, 1), 8, 1, 128, 32),
    Shape((33, 1, 2), (70, 12, 2), 2, 2, 128, 16),
    Shape((1, 17, 1), (64, 41, 30), 8, 1, 64, 32),
)


def make_batch(
    shape: Shape,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    block_table_pad: int = -1,
    unused_fill: float = 0.0,
) -> PagedBatch:
    """Build a batch for `shape`. Block-table entries past a sequence's last
    block hold `block_table_pad`; cache slots no sequence uses hold `unused_fill`."""
    gen = torch.Generator().manual_seed(seed)
    bs, kv_heads, dim = shape.block_size, shape.num_kv_heads, shape.head_dim
    blocks_per_seq = [-(-n // bs) for n in shape.seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns
    pool = torch.randperm(num_blocks, generator=gen).tolist()

    block_table = torch.full(
        (len(shape.seq_lens), max(blocks_per_seq) + 1), block_table_pad, dtype=torch.int32
    )
    kv_cache = torch.full((2, num_blocks, bs, kv_heads, dim), unused_fill, dtype=dtype)
    slots = kv_cache.view(2, -1, kv_heads, dim)
    contexts = []
    slot_mapping = []
    for i, (q_len, seq_len) in enumerate(zip(shape.q_lens, shape.seq_lens, strict=True)):
        owned = [pool.pop() for _ in range(blocks_per_seq[i])]
        block_table[i, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        seq_slots = [owned[p // bs] * bs + p % bs for p in range(seq_len)]
        kv = torch.randn(2, seq_len, kv_heads, dim, generator=gen).to(dtype)
        slots[:, seq_slots] = kv
        contexts.append((kv[0].float(), kv[1].float()))
        slot_mapping += seq_slots[seq_len - q_len :]

    query = torch.randn(sum(shape.q_lens), shape.num_heads, dim, generator=gen).to(dtype)
    starts = [0]
    for q_len in shape.q_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(shape.seq_lens, dtype=torch.int32),
        block_table=block_table,
        max_query_len=max(shape.q_lens),
        max_seq_len=max(shape.seq_lens),
        decode_only=max(shape.q_lens) == 1,
    )
    return PagedBatch(query, kv_cache, meta, contexts)


def new_kv_rows(
    batch: PagedBatch, *, seed: int = 1, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh K/V rows `[num_tokens, num_kv_heads, head_dim]` for the batch's new tokens."""
    gen = torch.Generator().manual_seed(seed)
    _, _, _, kv_heads, dim = batch.kv_cache.shape
    rows = torch.randn(2, batch.meta.num_tokens, kv_heads, dim, generator=gen)
    rows = rows.to(dtype or batch.kv_cache.dtype)
    return rows[0], rows[1]


def over_bfloat16(
    products: bool,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, float]:
    """The reference for a kernel over a bfloat16 cache, and its tolerance.
    Rows widened to float32: the same rows widened first, float32 rounding
    only. bfloat16 products (AVX512_BF16): the scaled query rounded to
    bfloat16 as the kernel rounds it, so scores agree to float32 rounding;
    the probabilities are rounded too (relative error <= 2^-9 each) while
    their sum stays float32, which moves an output by at most 2^-9 * max|V|
    (doubled here for the float32 sums)."""
    cache = kv_cache.float()
    if not products:
        return reference.paged_attention(query, cache, meta, scale, sliding_window), 2e-5
    rounded = (query * scale).to(torch.bfloat16).float()
    bound = 2**-8 * cache[1].abs().max().item() + 2e-5
    return reference.paged_attention(rounded, cache, meta, 1.0, sliding_window), bound
