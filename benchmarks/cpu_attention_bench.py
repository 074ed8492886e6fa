"""The compiled CPU attention kernels on the 64-request workload's shapes.

Two measurements, the default model's heads (9 query, 3 KV, head dim 64),
block size 16, 30 layers, a float32, bfloat16 or int8 cache (int8: quantized
rows, head-major in memory, as serving allocates them):

* prefill: 64 prompts of 32-512 tokens (the offline workload's lengths),
  fresh (no cached prefix), all in one batch per layer, through
  `kernels.torch_attention.paged_attention`: the compiled kernel
  (prefill_attention.cpp) against the torch path it replaces (one SDPA
  call per sequence: torch's CPU flash attention), alternating in one
  process, A, B, A, B. Reported: seconds for the 30 layers and GFLOP/s
  counting only the causal half (4 * heads * dim * L(L+1)/2 per prompt).
* decode: one token for each of the 64 sequences (contexts 96-544) over
  30 separate per-layer caches of the size serving gives them (2 GiB over
  30 layers, ~68 MiB each, the sequences' blocks scattered over all of it,
  so reads come from memory as in serving, not from the CPU's caches), on
  2 MiB pages as serving allocates them and the same bytes on 4 KiB pages,
  interleaved: milliseconds for the 30 layers and the K/V bytes read per
  second, next to a plain read of 512 MB in the same process.

Where the CPU has AVX512_BF16, the prefill kernel can take bfloat16 products
over a bfloat16 cache (its default except on Intel CPUs); the prefill
measurement then also times the other setting
(`allow_bf16_attention_products`), interleaved with the default in the same
rounds. An int8 cache takes bfloat16 products on AMX tiles only (timed
against its float32 arithmetic there) and has no torch path to compare
with (the torch path dequantizes gathered rows).

    .venv/bin/python benchmarks/cpu_attention_bench.py --rounds 3 --cache-dtypes bfloat16,int8

    .venv/bin/python benchmarks/cpu_attention_bench.py --rounds 5

The 1-minute load average is printed before and after (2 cores: one
foreign busy process halves everything). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from offline_throughput import read_bandwidth

from kernels import cpu_kernels, kv_int8, kv_layout, torch_attention
from kernels.metadata import AttentionMetadata

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype,
    caches: int,
    cache_bytes: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """Queries, `caches` caches and metadata. The batch's blocks lie scattered
    over each cache, which holds just them or, given `cache_bytes`, as many
    blocks as that many bytes hold (a serving cache's size)."""
    blocks = [-(-n // BLOCK) for n in seq_lens]
    block_bytes = 2 * BLOCK * KV_HEADS * _row_bytes(dtype)
    pool = max(sum(blocks) + 1, cache_bytes // block_bytes)
    order = torch.randperm(pool)[: sum(blocks)].tolist()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    kv = [_random_cache((2, pool, BLOCK, KV_HEADS, DIM), dtype) for _ in range(caches)]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        decode_only=max(q_lens) == 1,
    )
    return torch.randn(starts[-1], HEADS, DIM), kv, meta


def _row_bytes(dtype: torch.dtype) -> int:
    """Bytes of one (token, head) K or V row in a `dtype` cache."""
    if dtype == torch.int8:
        return kv_int8.int8_row_bytes(DIM)
    return DIM * torch.empty((), dtype=dtype).element_size()


def _random_cache(shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """Random K/V rows in `dtype`, in the memory order serving gives that
    dtype (an int8 cache: quantized rows, head-major; kernels/kv_layout.py),
    on ordinary pages."""
    rows = torch.randn(shape)
    if dtype == torch.int8:
        return kv_layout.as_head_major(kv_int8.quantize_rows(rows))
    return rows.to(dtype)


def timed_layers(query: torch.Tensor, caches: list[torch.Tensor], meta: AttentionMetadata) -> float:
    start = time.perf_counter()
    for layer in range(LAYERS):
        torch_attention.paged_attention(query, caches[layer % len(caches)], meta, DIM**-0.5)
    return time.perf_counter() - start


def _products(kernel: ModuleType, allowed: bool) -> Callable[[], None]:
    return lambda: kernel.allow_bf16_attention_products(allowed)


def prefill(args: argparse.Namespace, dtype: torch.dtype, kernel: ModuleType) -> None:
    rng = random.Random(0)
    lens = [rng.randint(32, 512) for _ in range(64)]
    query, caches, meta = paged_batch(lens, lens, dtype, 1)
    flops = sum(4 * HEADS * DIM * n * (n + 1) / 2 for n in lens) * LAYERS
    compiled = torch_attention._compiled_prefill
    # (how to choose the path, what to set before the round)
    default = kernel.allow_bf16_attention_products(True)
    capable = kernel.prefill_attention_bf16_products()
    if dtype == torch.int8:  # bfloat16 products over int8 rows: on AMX tiles only
        capable = capable and kernel.prefill_attention_on_tiles(DIM, caches[0])
    kernel.allow_bf16_attention_products(default)
    ways: dict[str, tuple[Callable[..., bool], Callable[[], None]]] = {
        "compiled kernel": (compiled, _products(kernel, default)),
    }
    if dtype in (torch.bfloat16, torch.int8) and capable:
        other = "compiled, float32 arithmetic" if default else "compiled, bfloat16 products"
        ways[other] = (compiled, _products(kernel, not default))
    if dtype != torch.int8:  # the torch path gathers and dequantizes int8: not a peer
        ways["torch (SDPA per sequence)"] = (lambda q, c: False, _products(kernel, default))
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, (choice, setting) in ways.items():
            torch_attention._compiled_prefill = choice
            setting()
            # A plan is made once per metadata object (per forward pass): a
            # new one, so that the choice takes effect.
            timed_layers(query, caches, dataclasses.replace(meta))  # warm
            times[name].append(timed_layers(query, caches, dataclasses.replace(meta)))
    torch_attention._compiled_prefill = compiled
    kernel.allow_bf16_attention_products(default)
    print(f"prefill, {dtype} cache: 64 prompts, {sum(lens)} tokens, {LAYERS} layers")
    for name, values in times.items():
        print(
            f"  {name:<30} {statistics.median(values):6.3f} s (min {min(values):.3f}, max "
            f"{max(values):.3f}) = {flops / statistics.median(values) / 1e9:5.1f} GFLOP/s causal"
        )
    first = times["compiled kernel"]
    for name, values in times.items():
        if name == "compiled kernel":
            continue
        ratios = [y / x for x, y in zip(first, values, strict=True)]
        print(
            f"  {name} / compiled kernel per round: {statistics.median(ratios):.2f}x "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
        )


def _on_huge_pages(cache: torch.Tensor) -> torch.Tensor:
    """A copy of `cache` on 2 MiB pages, as serving allocates it (new_cache)."""
    kv, blocks, block_size, heads, row = (int(n) for n in cache.shape)
    copy = kv_layout.new_cache((kv, blocks, block_size, heads, row), cache.dtype, "cpu")
    copy.copy_(cache)
    return copy


def decode(args: argparse.Namespace, dtype: torch.dtype) -> None:
    rng = random.Random(1)
    lens = [rng.randint(96, 544) for _ in range(64)]
    # Each layer's cache as big as the offline workload's (2 GiB over 30 layers).
    query, caches, meta = paged_batch([1] * 64, lens, dtype, LAYERS, 2 * 2**30 // LAYERS)
    kv_bytes = sum(lens) * KV_HEADS * _row_bytes(dtype) * 2 * LAYERS
    # Serving's caches are on 2 MiB pages (kernels/kv_layout.py new_cache);
    # the same bytes on 4 KiB pages, interleaved, show what that buys.
    ways = {"2 MiB pages (serving's)": [_on_huge_pages(c) for c in caches], "4 KiB pages": caches}
    times: dict[str, list[float]] = {name: [] for name in ways}
    reads = []
    for layers in ways.values():
        timed_layers(query, layers, meta)
    for _ in range(args.rounds):
        for name, layers in ways.items():
            times[name].append(min(timed_layers(query, layers, meta) for _ in range(3)))
        reads.append(read_bandwidth())
    print(f"decode, {dtype} cache: 64 sequences, contexts 96-544, {LAYERS} per-layer caches")
    for name, values in times.items():
        step = statistics.median(values)
        print(
            f"  {name:<24} {step * 1e3:.1f} ms (min {min(values) * 1e3:.1f}, max "
            f"{max(values) * 1e3:.1f}) = {kv_bytes / step / 1e9:.1f} GB/s of K/V"
        )
    first, second = ways
    ratios = [b / a for a, b in zip(times[first], times[second], strict=True)]
    print(
        f"  4 KiB / 2 MiB pages per round: {statistics.median(ratios):.2f}x (min "
        f"{min(ratios):.2f}, max {max(ratios):.2f}); plain read "
        f"{statistics.median(reads) / 1e9:.1f} GB/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_kernels.load()
    if kernel is None or not kernel.prefill_attention_applies(DIM, HEADS // KV_HEADS, BLOCK):
        sys.exit("the compiled prefill kernel does not apply here (no AVX-512 or no toolchain)")
    print(f"load before: {os.getloadavg()}")
    with torch.inference_mode():
        for name in args.cache_dtypes.split(","):
            dtype = getattr(torch, name)
            prefill(args, dtype, kernel)
            decode(args, dtype)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
