"""The int8 path's many-row calls as bfloat16 GEMMs on AMX tiles, against the int8 kernels.

On CPUs with AMX-BF16, int8-activation calls of `kernels.quant.amx_bf16_rows()`
rows and more (prefill chunks) round their inputs to bfloat16 and run as
one oneDNN bfloat16 GEMM over the weight expanded for the call
(kernels/csrc/quant_gemm.cpp). Two measurements, each switching the path
in one process (`set_amx_bf16_rows`), interleaved A, B, A, B:

* kernels: the default model's four layer shapes in Q4_1 at 256-8192 rows,
  milliseconds per call and the largest error against a float64 product,
  relative to the largest output;
* the engine: the default model (or ``--model``), single stream and the
  64 mixed requests (prompts of 32-512 tokens, 128 output tokens each),
  whose prefill chunks of up to 8,192 tokens take the path.

Medians with min and max; the load average before and after. Nothing is
asserted.

    .venv/bin/python benchmarks/amx_bf16_gemm_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import make_prompts, median_ms, switched_runs  # noqa: E402

from engine.llm import LLM  # noqa: E402
from kernels import quant  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _q4_1(out_features: int, in_features: int) -> quant.QuantizedWeight:
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(out_features, in_features) * 0.02
    raw = quants.quantize(w.numpy(), GGMLQuantizationType.Q4_1)
    return quant.from_gguf_rows(torch.from_numpy(raw), "q4_1", in_features, True)


def kernels(rounds: int, rows: list[int], default: int) -> None:
    for name, (n, k) in SHAPES.items():
        weight = _q4_1(n, k)
        exact = weight.dequantize().double()
        for m in rows:
            x = torch.randn(m, k)
            ref = x.double() @ exact.t()
            times: dict[str, list[float]] = {"int8": [], "bf16 AMX": []}
            errors: dict[str, float] = {}
            for _ in range(rounds):
                for way, threshold in (("int8", 0), ("bf16 AMX", 1)):
                    quant.set_amx_bf16_rows(threshold)
                    times[way].append(median_ms(partial(quant.quant_linear, x, weight, None)))
                    out = quant.quant_linear(x, weight, None).double()
                    errors[way] = float((out - ref).abs().max() / ref.abs().max())
            quant.set_amx_bf16_rows(default)
            a, b = (statistics.median(times[w]) for w in ("int8", "bf16 AMX"))
            print(
                f"{name:8s} {n}x{k} {m:5d} rows: int8 {a:7.2f} ms (err {errors['int8']:.1e})"
                f"  bf16 AMX {b:7.2f} ms (err {errors['bf16 AMX']:.1e})  int8 / bf16 {a / b:.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="256,512,1024,2048,8192")
    parser.add_argument("--model", default=None, help="the engine part's (default model)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    default = quant.amx_bf16_rows()
    if default is None:
        raise SystemExit("no AMX-BF16 here (or turned off): nothing to compare")
    print(f"load before: {os.getloadavg()[0]:.2f}; threshold {default} rows")
    if not args.skip_kernels:
        kernels(args.rounds, [int(r) for r in args.rows.split(",")], default)
    llm = LLM(model=args.model, max_model_len=1024)
    prompts = make_prompts(64, 32, 512, llm.core.info.vocab_size)

    def use(threshold: int) -> int:
        quant.set_amx_bf16_rows(threshold)
        return 1

    ways = {"bf16 AMX": lambda: use(default), "int8": lambda: use(0)}
    try:
        switched_runs(llm, ways, args.rounds, args.new_tokens, prompts)
    finally:
        quant.set_amx_bf16_rows(default)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
