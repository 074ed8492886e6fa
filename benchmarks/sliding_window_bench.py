"""Decode attention of a windowed layer: what reading only the window saves.

Gemma 3 270M's attention shape (4 query heads, 1 KV head, head dim 256,
block size 16) at its 512-token window: one decode token for each of
`--seqs` sequences with `--context`-token contexts, through
`kernels.torch_attention.paged_attention` (the compiled CPU decode kernel),
with `sliding_window=512` (a local layer) and without (a global layer),
alternating A, B, A, B in one process. Each layer has its own cache, sized
as serving would (`--cache-mib` each, the sequences' blocks scattered over
it), so K/V come from memory rather than the CPU's caches. Reported:
milliseconds per layer and the K/V bytes each layer reads per step.

    .venv/bin/python benchmarks/sliding_window_bench.py --rounds 7

The 1-minute load average is printed before and after (2 cores: one foreign
busy process halves everything). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from kernels import torch_attention
from kernels.metadata import AttentionMetadata

HEADS, KV_HEADS, DIM, BLOCK, WINDOW, LAYERS = 4, 1, 256, 16, 512, 6


def decode_batch(
    seqs: int, context: int, cache_mib: int
) -> tuple[torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """Queries, one float32 cache per layer, and the metadata of a decode step."""
    blocks = -(-context // BLOCK)
    block_bytes = 2 * BLOCK * KV_HEADS * DIM * 4
    pool = max(seqs * blocks + 1, cache_mib * 2**20 // block_bytes)
    order = torch.randperm(pool)[: seqs * blocks]
    table = order.view(seqs, blocks).to(torch.int32)
    caches = [torch.randn(2, pool, BLOCK, KV_HEADS, DIM) for _ in range(LAYERS)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(seqs, dtype=torch.int64),
        query_start_loc=torch.arange(seqs + 1, dtype=torch.int32),
        seq_lens=torch.full((seqs,), context, dtype=torch.int32),
        block_table=table,
        max_query_len=1,
        max_seq_len=context,
        decode_only=True,
    )
    return torch.randn(seqs, HEADS, DIM), caches, meta


def per_layer_ms(
    query: torch.Tensor, caches: list[torch.Tensor], meta: AttentionMetadata, window: int | None
) -> float:
    start = time.perf_counter()
    for cache in caches:
        torch_attention.paged_attention(query, cache, meta, DIM**-0.5, window)
    return (time.perf_counter() - start) / len(caches) * 1e3


def kv_bytes(seqs: int, tokens: int) -> int:
    """K and V of `tokens` positions (whole blocks) for every sequence, one layer."""
    return seqs * -(-tokens // BLOCK) * BLOCK * 2 * KV_HEADS * DIM * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--cache-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    query, caches, meta = decode_batch(args.seqs, args.context, args.cache_mib)
    ways: dict[str, int | None] = {"global (no window)": None, f"local (window {WINDOW})": WINDOW}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, window in ways.items():
            per_layer_ms(query, caches, meta, window)  # warm: the plan, the pages
            times[name].append(per_layer_ms(query, caches, meta, window))
    print(
        f"decode of {args.seqs} sequences x {args.context} tokens, Gemma 3 270M heads "
        f"({HEADS}/{KV_HEADS} x {DIM}), float32 cache, per layer:"
    )
    base = statistics.median(times["global (no window)"])
    for name, window in ways.items():
        values = times[name]
        read = kv_bytes(args.seqs, args.context if window is None else window + BLOCK)
        print(
            f"  {name:<22} {statistics.median(values):7.3f} ms (min {min(values):.3f}, "
            f"max {max(values):.3f})  {base / statistics.median(values):5.2f}x  "
            f"reads <= {read / 2**20:6.2f} MiB of K/V"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
