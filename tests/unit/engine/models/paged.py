"""Drive a Tandem model through a paged KV cache the way the runner will.

Each sequence owns a shuffled, non-contiguous list of cache blocks; a step
feeds some token range of some sequences in one flat batch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.models.llama import LlamaForCausalLM
from kernels import kv_layout, reference
from kernels.kv_int8 import int8_row_bytes
from kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class ReferenceOps:
    reshape_and_cache: Callable[..., None] = reference.reshape_and_cache
    paged_attention: Callable[..., torch.Tensor] = reference.paged_attention


REFERENCE_OPS = ReferenceOps()


@dataclass(frozen=True)
class PagedSequences:
    """Per-sequence tokens and block ids over one shared set of layer caches."""

    tokens: list[list[int]]
    blocks: list[list[int]]
    block_size: int
    kv_caches: list[torch.Tensor]


def allocate(
    model: LlamaForCausalLM,
    tokens: list[list[int]],
    *,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedSequences:
    spec = model.spec
    per_seq = [-(-len(t) // block_size) for t in tokens]
    num_blocks = sum(per_seq) + 3  # a few never used, so ids are sparse too
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    blocks, taken = [], 0
    for n in per_seq:
        blocks.append(ids[taken : taken + n])
        taken += n
    # An int8 cache's rows carry their float32 scale (kernels/kv_int8.py).
    row = int8_row_bytes(spec.head_dim) if dtype == torch.int8 else spec.head_dim
    shape = (2, num_blocks, block_size, spec.num_kv_heads, row)
    caches = [kv_layout.new_cache(shape, dtype, "cpu") for _ in range(spec.num_layers)]
    return PagedSequences(tokens, blocks, block_size, caches)


def step(
    model: LlamaForCausalLM,
    seqs: PagedSequences,
    chunks: Sequence[tuple[int, int, int]],
    layer_blocks: Sequence[PagedSequences] | None = None,
) -> list[torch.Tensor]:
    """Run one forward over `chunks` of (sequence, start, end) token ranges, each
    sequence's earlier tokens already cached; returns each chunk's logits [end-start, V].

    ``layer_blocks``: per layer, whose block ids it uses (as KV cache groups
    give each layer its group's block table and slots); the caches are
    ``seqs``' whichever. None: ``seqs``' for every layer."""
    ids = [t for s, start, end in chunks for t in seqs.tokens[s][start:end]]
    positions = [p for _, start, end in chunks for p in range(start, end)]
    meta = _metadata(seqs, chunks)
    layer_metas = None
    if layer_blocks is not None:
        by_id = {id(blocks): _metadata(blocks, chunks) for blocks in layer_blocks}
        layer_metas = [by_id[id(blocks)] for blocks in layer_blocks]
    with torch.inference_mode():
        hidden = model(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            seqs.kv_caches,
            meta,
            layer_metas,
        )
        logits = model.compute_logits(hidden)
    return list(torch.split(logits, [end - start for _, start, end in chunks]))


def _metadata(seqs: PagedSequences, chunks: Sequence[tuple[int, int, int]]) -> AttentionMetadata:
    bs = seqs.block_size
    slots: list[int] = []
    starts = [0]
    width = max(len(b) for b in seqs.blocks)
    table = []
    for s, start, end in chunks:
        slots += [seqs.blocks[s][p // bs] * bs + p % bs for p in range(start, end)]
        starts.append(starts[-1] + end - start)
        table.append(seqs.blocks[s] + [0] * (width - len(seqs.blocks[s])))
    query_lens = [end - start for _, start, end in chunks]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([end for _, _, end in chunks], dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(end for _, _, end in chunks),
        decode_only=all(n == 1 for n in query_lens),
    )
