"""Gemma 3 270M (Q4_K_M) on the default path: its K-quant weights (Q4_K,
Q6_K) with int8 activations against float32 activations (issue 42's K-quant
int8 kernels).

The default path runs GGUF blocks with int8 activations. K-quant weights took
float32 inputs until they had int8 kernels; the Q5_0/Q8_0 ones had int8
inputs all along. One engine (the default settings, a bfloat16 KV cache)
runs both ways, its K-quant weights switched between runs (A, B, A, B):
single stream (a 64-token prompt, then 127 timed decode steps: tokens/s =
1 / median step) and 64 mixed requests (prompts of 32-512 token ids, 128
output tokens each, all at once: output tokens/s). Medians with min and max;
the load average before and after (2 cores: a foreign busy process slows
both alike).

    .venv/bin/python benchmarks/kquant_int8_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import decode_step_times, make_prompts, run_tandem  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.models.loader import GEMMA3_MODEL  # noqa: E402
from kernels.quant import QuantizedWeight  # noqa: E402


def set_k_quant_int8(llm: LLM, on: bool) -> int:
    """Switch every K-quant weight's int8 activations; returns how many."""
    count = 0
    for module in llm.core.worker.loaded.model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, QuantizedWeight) and packed.format in ("q4_k", "q6_k"):
            setattr(module, "packed", dataclasses.replace(packed, int8_activations=on))  # noqa: B010
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(model=GEMMA3_MODEL, max_model_len=1024, kv_cache_memory=2**30)
    numerics = llm.core.info.numerics
    print(f"numerics: {numerics.path}, {numerics.activations}, KV {numerics.kv_cache_dtype}")
    prompts = make_prompts(64, 32, 512, llm.core.info.vocab_size)
    ways = {"K-quant int8 act": True, "K-quant float act": False}
    single: dict[str, list[float]] = {name: [] for name in ways}
    offline: dict[str, list[float]] = {name: [] for name in ways}
    print(f"load before: {os.getloadavg()}; threads: {torch.get_num_threads()}")
    for r in range(args.rounds):
        for name, on in ways.items():
            switched = set_k_quant_int8(llm, on)
            steps = decode_step_times(llm, steps=args.new_tokens - 1)
            single[name].append(1 / statistics.median(steps))
            offline[name].append(run_tandem(llm, prompts, args.new_tokens))
            print(
                f"  round {r + 1}: {name:<17} ({switched} weights) single "
                f"{single[name][-1]:6.1f} tok/s  64 requests {offline[name][-1]:6.1f} tok/s",
                flush=True,
            )
    print(f"load after: {os.getloadavg()}")
    for label, table in (("single stream", single), ("64 mixed requests", offline)):
        print(f"{label}, tokens/s:")
        for name, values in table.items():
            print(
                f"  {name:<17} median {statistics.median(values):7.1f} "
                f"(min {min(values):.1f}, max {max(values):.1f})"
            )
        a, b = (table[name] for name in ways)
        print(f"  int8 / float per round: {[f'{x / y:.2f}' for x, y in zip(a, b, strict=True)]}")


if __name__ == "__main__":
    main()
