"""How many long requests a KV budget holds, with and without windowed groups.

Gemma 3 270M's KV shape (18 layers, five local in six with a 512-token
window, 1 KV head of dim 256, bfloat16, blocks of 16 tokens) in the CPU's
default 2 GiB KV budget. Requests of `--tokens` tokens are prefilled in
chunks of `--chunk` through the real `KVCacheManager` until the pool runs
out (each then takes its first decode step), once with one KV cache group
(every layer keeps every block: what a KV connector or a draft model gets)
and once with the hybrid groups
(`engine.kv_cache.groups`: 1 full + 5 windowed groups of 3 layers). This
counts blocks, so it is exact and takes no timing: reported are the bytes
each request holds and how many requests fit, the ratio hybrid / single.

    .venv/bin/python benchmarks/windowed_kv_capacity.py --tokens 1024 4096 32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES
from engine.kv_cache.groups import KVCacheGroups
from engine.kv_cache.hashing import BlockHasher
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

LAYER_WINDOWS = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
BLOCK = 16
# K and V, 1 KV head, head dim 256, bfloat16: per token and layer.
BYTES_PER_TOKEN_LAYER = 2 * 1 * 256 * 2


def fit(groups: KVCacheGroups, tokens: int, chunk: int) -> tuple[int, int]:
    """(requests that fit, bytes one request holds) for this grouping."""
    block_bytes = BLOCK * BYTES_PER_TOKEN_LAYER * groups.layers_per_group
    num_blocks = DEFAULT_CPU_KV_CACHE_BYTES // block_bytes
    kvm = KVCacheManager(
        num_blocks,
        BLOCK,
        max_model_len=tokens,
        enable_caching=False,
        group_windows=groups.windows,
    )
    count = 0
    held = 0
    while True:
        req = Request(
            f"r{count}",
            [count % 50_000] * tokens,
            SamplingParams(),
            block_hasher=BlockHasher(BLOCK),
        )
        while req.num_computed_tokens < tokens:
            n = min(chunk, tokens - req.num_computed_tokens)
            if kvm.allocate_slots(req, n) is None:
                return count, held
            req.num_computed_tokens += n
        # Its first decode step: what it holds while it generates.
        req.append_output_token_id(1)
        if kvm.allocate_slots(req, 1) is None:
            return count, held
        held = kvm.num_held_blocks(req.request_id) * block_bytes
        count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 32768])
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    args = parser.parse_args()
    single = KVCacheGroups.plan(LAYER_WINDOWS, free_windowed=False)
    hybrid = KVCacheGroups.plan(LAYER_WINDOWS, free_windowed=True)
    print(f"budget {DEFAULT_CPU_KV_CACHE_BYTES / 2**30:.0f} GiB, chunk {args.chunk} tokens")
    print("| tokens | one group: MiB/request, requests | hybrid: MiB/request, requests | ratio |")
    print("|---:|---:|---:|---:|")
    for tokens in args.tokens:
        n1, b1 = fit(single, tokens, args.chunk)
        n2, b2 = fit(hybrid, tokens, args.chunk)
        print(
            f"| {tokens:,} | {b1 / 2**20:.1f}, {n1} | {b2 / 2**20:.1f}, {n2} | "
            f"{n2 / max(n1, 1):.2f}x |"
        )


if __name__ == "__main__":
    main()
