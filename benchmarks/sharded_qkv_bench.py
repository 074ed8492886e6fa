"""A Q4_K_M file's mixed fused qkv (Q4_K q and k, a Q6_K v) as shards in
their blocks against the float32 expansion it had before (issue 42).

Llama 3.2 1B's attention shape (hidden 2048; q 2048, k 512, v 512 rows):
`--layers` copies of the weight each way, called in turn so that the bytes
come from memory, not cache (this machine kind's L3 is up to 480 MiB), as
a decode step's layers do. Per row count, each way's time per call:
the shards (`kernels.quant.quant_linear` over a `ShardedWeight`, one kernel
call a shard) and float32 through the compiled ops' linear (small_linear or
MKL's packed GEMM, as the layers run a float weight), the shards with
float32 inputs (exact) or int8 ones (`--int8-activations`, the default
path on a GGUF). Interleaved (A, B,
A, B), medians with min/max of the per-round ratios; load before and after.

    .venv/bin/python benchmarks/sharded_qkv_bench.py --rounds 5 [--int8-activations]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from kernels import cpu_kernels  # noqa: E402
from kernels.layer_ops import compiled_ops  # noqa: E402
from kernels.quant import ShardedWeight, from_gguf_rows, join_rows, quant_linear  # noqa: E402
from tests.unit.kernels.kquant_blocks import Q4_K, Q6_K, random_rows  # noqa: E402

HIDDEN = 2048
SHARDS = (("q4_k", Q4_K, 2048), ("q4_k", Q4_K, 512), ("q6_k", Q6_K, 512))


def sharded(seed: int, int8_activations: bool) -> ShardedWeight:
    parts = []
    for i, (fmt, qtype, rows) in enumerate(SHARDS):
        raw = torch.from_numpy(random_rows(qtype, rows, HIDDEN, seed=seed + i))
        parts.append(from_gguf_rows(raw, fmt, HIDDEN, int8_activations))
    weight = join_rows(parts)
    assert isinstance(weight, ShardedWeight)
    return weight


def timed(calls: list[Callable[[], object]]) -> float:
    """Seconds per call, over one pass through every copy."""
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        help="the shards' inputs in int8 (the default path)",
    )
    args = parser.parse_args()
    module = cpu_kernels.load()
    if module is None:
        raise SystemExit("the compiled CPU kernels did not build")
    lops = compiled_ops(module)
    shards = [sharded(10 * i, args.int8_activations) for i in range(args.layers)]
    floats = [w.dequantize() for w in shards]
    packed = [lops.pack_linear(w) for w in floats]
    mb = sum(w.nbytes for w in shards) / 1e6, sum(w.numel() * 4 for w in floats) / 1e6
    print(
        f"{args.layers} weights of {shards[0].out_features}x{HIDDEN}: shards {mb[0]:.0f} MB, "
        f"float32 {mb[1]:.0f} MB; load before {os.getloadavg()}"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN)
        ways: dict[str, list[Callable[[], object]]] = {
            "shards": [functools.partial(quant_linear, x, w, None) for w in shards],
            "float32": [
                functools.partial(lops.linear, x, w, None, p)
                for w, p in zip(floats, packed, strict=True)
            ],
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for calls in ways.values():
            timed(calls)  # warm-up
        for _ in range(args.rounds):
            for name, calls in ways.items():
                times[name].append(timed(calls))
        ratios = [f / s for s, f in zip(times["shards"], times["float32"], strict=True)]
        line = "  ".join(
            f"{name} {statistics.median(t) * 1e6:7.1f} us" for name, t in times.items()
        )
        print(
            f"rows {rows:3d}: {line}  shards faster by x{statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})",
            flush=True,
        )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
