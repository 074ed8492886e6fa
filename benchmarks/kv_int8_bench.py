"""Decode attention over an int8 KV cache against a bfloat16 one.

The compiled decode kernel (kernels/csrc/decode_attention.cpp) through
`kernels.torch_attention.paged_attention`, float32 queries, the default
model's heads (9 query, 3 KV, head dim 64), block size 16, 30 layers, each
layer its own cache with the batch's blocks scattered over twice as many
blocks as it needs (reads come from memory), or with ``--contiguous`` each
sequence's blocks in a row, as a fresh engine's prefills leave them (the
hardware prefetcher then streams the reads: bfloat16 nearly doubles its
rate; benchmarks/README.md). The int8 cache is head-major in memory, as
the engine allocates it (kernels/kv_layout.py); ``--int8-layout
token-major`` measures the order it had before. Two batches:
16 sequences of 1.5k tokens (the issue's target: int8 at least 1.3x
bfloat16) and 64 of 512. The two caches run interleaved (int8, bfloat16,
int8, ...); reported: the milliseconds of the 30 layers' attention, median
with min and max, and the bfloat16 / int8 ratio per round and of the medians.

    .venv/bin/python benchmarks/kv_int8_bench.py --rounds 7
    .venv/bin/python benchmarks/kv_int8_bench.py --rounds 7 --contiguous

The 1-minute load average is printed before and after (2 cores: a foreign
busy process slows both caches). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from kernels import cpu_kernels, kv_int8, kv_layout, torch_attention  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
DTYPES = {"int8": torch.int8, "bfloat16": torch.bfloat16}


def decode_meta(num_seqs: int, seq_len: int, pool: int, contiguous: bool) -> AttentionMetadata:
    """One decode token per sequence; the sequences' blocks scattered over
    `pool` blocks, or each sequence's blocks in a row (as a fresh engine's
    prefills leave them)."""
    per_seq = -(-seq_len // BLOCK)
    if contiguous:
        order = torch.arange(num_seqs * per_seq, dtype=torch.int32)
    else:
        order = torch.randperm(pool)[: num_seqs * per_seq].to(torch.int32)
    table = order.view(num_seqs, per_seq)
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    last = (table[:, -1].long() * BLOCK + (seq_len - 1) % BLOCK).contiguous()
    return AttentionMetadata(
        slot_mapping=last,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=lens,
        block_table=table,
        max_query_len=1,
        max_seq_len=seq_len,
        decode_only=True,
    )


def make_caches(dtype: torch.dtype, pool: int, int8_layout: str) -> list[torch.Tensor]:
    """LAYERS caches of random K/V (quantized for int8, in `int8_layout`:
    head-major as the engine allocates it, or token-major as before
    2026-11-29): one layer filled, the others copies of it."""
    values = torch.randn(2, pool, BLOCK, KV_HEADS, HEAD_DIM)
    first = kv_int8.quantize_rows(values) if dtype == torch.int8 else values.to(dtype)
    if dtype == torch.int8 and int8_layout == "head-major":
        first = kv_layout.as_head_major(first)
    del values
    return [first] + [first.clone() for _ in range(LAYERS - 1)]


def timed_layers(query: torch.Tensor, caches: list[torch.Tensor], meta: AttentionMetadata) -> float:
    """Milliseconds for one decode's attention in every layer."""
    start = time.perf_counter()
    for cache in caches:
        torch_attention.paged_attention(query, cache, meta, HEAD_DIM**-0.5)
    return (time.perf_counter() - start) * 1e3


def run_batch(num_seqs: int, seq_len: int, rounds: int, contiguous: bool, int8_layout: str) -> None:
    pool = 2 * num_seqs * -(-seq_len // BLOCK)
    meta = decode_meta(num_seqs, seq_len, pool, contiguous)
    query = torch.randn(num_seqs, HEADS, HEAD_DIM)
    # Both sets of caches stay allocated (~1.7 GB at 16 x 1.5k): 30 layers'
    # K/V are far more than the CPU's caches hold, so every pass reads memory.
    caches = {name: make_caches(dtype, pool, int8_layout) for name, dtype in DTYPES.items()}
    times: dict[str, list[float]] = {name: [] for name in DTYPES}
    for name in DTYPES:
        timed_layers(query, caches[name], meta)  # warm: the plan, the pages
    for _ in range(rounds):
        for name in DTYPES:
            times[name].append(min(timed_layers(query, caches[name], meta) for _ in range(3)))
    row_bytes = {"int8": kv_int8.int8_row_bytes(HEAD_DIM), "bfloat16": 2 * HEAD_DIM}
    kv_mib = {
        name: LAYERS * num_seqs * seq_len * 2 * KV_HEADS * row_bytes[name] / 2**20
        for name in DTYPES
    }
    layout = "contiguous" if contiguous else "scattered"
    print(
        f"decode, {num_seqs} x {seq_len} tokens, {LAYERS} layers, blocks {layout}, "
        f"int8 {int8_layout}:"
    )
    for name, values in times.items():
        print(
            f"  {name:<8} median {statistics.median(values):7.2f} ms "
            f"(min {min(values):.2f}, max {max(values):.2f}); "
            f"{kv_mib[name]:.0f} MiB of K/V read, "
            f"{kv_mib[name] / 1024 / (statistics.median(values) / 1e3):.1f} GiB/s"
        )
    ratios = [b / a for a, b in zip(times["int8"], times["bfloat16"], strict=True)]
    medians = statistics.median(times["bfloat16"]) / statistics.median(times["int8"])
    print(f"  bfloat16 / int8 time per round: {[f'{r:.2f}' for r in ratios]}")
    print(f"  bfloat16 / int8 of the medians: {medians:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--contiguous",
        action="store_true",
        help="each sequence's blocks in a row (a fresh engine's layout), not scattered",
    )
    parser.add_argument(
        "--int8-layout",
        choices=("head-major", "token-major"),
        default="head-major",
        help="the int8 cache's memory order (kernels/kv_layout.py; the engine's is head-major)",
    )
    args = parser.parse_args()
    if cpu_kernels.load() is None:
        sys.exit("the compiled CPU kernels are unavailable: nothing to measure")
    torch.manual_seed(0)
    print(f"load before: {os.getloadavg()}; threads: {torch.get_num_threads()}")
    for num_seqs, seq_len in ((16, 1536), (64, 512)):
        run_batch(num_seqs, seq_len, args.rounds, args.contiguous, args.int8_layout)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
