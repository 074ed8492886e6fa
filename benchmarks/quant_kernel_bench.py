"""The quantized linear kernels against float32 + MKL, per number of input rows.

For each row count, one decoder layer's four linear shapes of the default
model (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), called in
layer order: float32 `F.linear` (MKL) as the baseline, then
`kernels.quant.quant_linear` on the same weights in q4_1, q8_0, int8 and
bf16, and the integer formats with int8 activations on each SIMD path the
build has (`--isas`: avx2, and avx512 where the CPU has AVX-512 VNNI).
Configurations interleaved within each round (A, B, C, ... A, B, C),
medians over rounds with min/max of the per-round ratios; the 1-minute load
average is printed before and after (the machine has 2 cores: one foreign
busy process halves everything).

Below 128 rows the kernels convert each vector of weights in registers for
up to 8 rows; from 128 on they expand panels for ATen's GEMM
(kernels/csrc/quant_gemm.cpp). bf16 hands over from 32 rows: to the GEMM,
or where the CPU has AVX512_BF16 to bfloat16 dot products (then "bf16
[avx2]" times the float32-input path as well). The weights are small enough to stay in
cache here, so this measures compute, not memory: the single-stream decode
step (memory) is benchmarks/decode_step_breakdown.py's.

Then, per row count, the MLP's down projection with its activation, q4_1 +
int8 activations: `silu_mul` then `quant_linear` against `quant_linear_silu`
(the activation quantized as it is computed, never written out),
interleaved in the same rounds, with the per-round speed ratio.

    .venv/bin/python benchmarks/quant_kernel_bench.py --rows 1,8,32,64,128,512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_kernels
from kernels.quant import (
    QuantizedWeight,
    available_isas,
    bf16_dot_rows,
    from_gguf_rows,
    quant_linear,
    quant_linear_silu,
    quantize_int8,
    to_bf16,
)

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
GGML = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def quantized(fmt: str, w: torch.Tensor) -> QuantizedWeight:
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "bf16":
        return to_bf16(w)
    raw = quants.quantize(w.numpy(), GGML[fmt])
    return from_gguf_rows(torch.from_numpy(np.ascontiguousarray(raw)), fmt, w.shape[1])


def layer_calls(rows: int, isas: list[str], seed: int = 0) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, k, generator=gen) / k**0.5 for n, k in SHAPES]
    inputs = [torch.randn(rows, k, generator=gen) for _, k in SHAPES]
    calls: dict[str, Callable[[], None]] = {}

    def float32() -> None:
        for w, x in zip(weights, inputs, strict=True):
            F.linear(x, w)

    calls["float32 (MKL)"] = float32
    for fmt in ("q4_1", "q8_0", "int8", "bf16"):
        qws = [quantized(fmt, w) for w in weights]
        calls[fmt] = _quant_call(qws, inputs, None)
        if fmt == "bf16":
            # Where the best path multiplies bfloat16 inputs (AVX512_BF16),
            # the float32-input path too.
            if bf16_dot_rows() is not None:
                calls["bf16 [avx2]"] = _quant_call(qws, inputs, "avx2")
            continue
        acts = [
            QuantizedWeight(q.format, q.out_features, q.in_features, q.packed, True) for q in qws
        ]
        for isa in isas:
            calls[f"{fmt} + int8 act [{isa}]"] = _quant_call(acts, inputs, isa)
    return calls


def down_calls(rows: int, seed: int = 0) -> dict[str, Callable[[], None]]:
    """The down projection (576 x 1536) of silu(gate) * up, unfused and fused."""
    module = cpu_kernels.load()
    assert module is not None, "the compiled kernels are needed"
    gen = torch.Generator().manual_seed(seed)
    n, k = SHAPES[3]
    packed = quantized("q4_1", torch.randn(n, k, generator=gen) / k**0.5)
    qw = QuantizedWeight(packed.format, n, k, packed.packed, True)
    gate_up = torch.randn(rows, 2 * k, generator=gen) * 2
    act = torch.empty(rows, k)

    def unfused() -> None:
        module.silu_mul(act, gate_up)
        quant_linear(act, qw, None)

    def fused() -> None:
        quant_linear_silu(gate_up, qw, None)

    return {"silu_mul + down": unfused, "fused": fused}


def report_down(rows: int, times: dict[str, list[float]]) -> None:
    unfused, fused = times["silu_mul + down"], times["fused"]
    ratios = [u / f for u, f in zip(unfused, fused, strict=True)]
    print(
        f"  down with its activation: silu_mul + quant_linear "
        f"{statistics.median(unfused) * 1e6:.0f} us, quant_linear_silu "
        f"{statistics.median(fused) * 1e6:.0f} us: x{statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f})",
        flush=True,
    )


def _quant_call(
    qws: list[QuantizedWeight], inputs: list[torch.Tensor], isa: str | None
) -> Callable[[], None]:
    def run() -> None:
        for qw, x in zip(qws, inputs, strict=True):
            quant_linear(x, qw, None, isa=isa)

    return run


def timed(fn: Callable[[], None], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,32,64,128,512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--isas",
        default=",".join(available_isas()[1:]),
        help="code paths to time the int8-activation kernels on (default: the SIMD ones built)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    flops_per_row = sum(2 * n * k for n, k in SHAPES)
    for rows in (int(r) for r in args.rows.split(",")):
        calls = layer_calls(rows, args.isas.split(","))
        downs = down_calls(rows)
        calls.update(downs)
        repeat = max(1, 256 // rows)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for fn in calls.values():
            timed(fn, repeat)  # warm-up
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(timed(fn, repeat))
        base = times["float32 (MKL)"]
        print(f"\n{rows} rows:")
        for name, values in times.items():
            if name in downs:
                continue
            ratios = [b / v for b, v in zip(base, values, strict=True)]
            gflops = flops_per_row * rows / statistics.median(values) / 1e9
            print(
                f"  {name:<26} {statistics.median(values) * 1e6:8.0f} us  {gflops:6.1f} GFLOP/s"
                f"  x{statistics.median(ratios):.2f} float32 (min {min(ratios):.2f}, "
                f"max {max(ratios):.2f})",
                flush=True,
            )
        report_down(rows, times)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
