"""Gemma 3 270M (Q4_K_M) on the default path: its fused qkv weights of mixed
GGUF formats kept in their blocks against expanded to float32.

Nine of the file's 18 layers have Q5_0 q/k and a Q8_0 v. Both are Q8 tiles,
so since 2026-11-29 the loader joins them (`kernels.quant.concat_rows`);
before, a fused weight of mixed formats was expanded to float32 (with MKL's
packed copy), 3.9 MB a layer read each step against 1.0 MB. One engine (the
default settings) runs both ways, the nine weights switched between runs
(A, B, A, B): single stream (127 timed decode steps: tokens/s = 1 / median
step) and 64 mixed requests (prompts of 32-512 token ids, 128 output tokens
each, all at once). Medians with min and max; the load average before and
after (2 cores: a foreign busy process slows both alike).

    .venv/bin/python benchmarks/joined_qkv_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import decode_step_times, make_prompts, run_tandem  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.models.layers import Linear  # noqa: E402
from engine.models.loader import GEMMA3_MODEL  # noqa: E402
from kernels.quant import QuantizedWeight  # noqa: E402


class JoinedWeights:
    """The model's joined weights (formats like 'q5_0/q8_0'), switchable to
    float32 copies and back."""

    def __init__(self, llm: LLM) -> None:
        self.modules = [
            (m, m.weight, m.packed)
            for m in llm.core.worker.loaded.model.modules()
            if isinstance(m, Linear)
            and isinstance(m.packed, QuantizedWeight)
            and "/" in m.packed.format
        ]
        self.floats = [
            nn.Parameter(packed.dequantize(), requires_grad=False) for _, _, packed in self.modules
        ]

    def use(self, blocks: bool) -> int:
        for (module, placeholder, packed), weight in zip(self.modules, self.floats, strict=True):
            if blocks:
                module.weight, module.packed = placeholder, packed
            else:
                module.weight, module.packed = weight, None
                module.pack()  # MKL's packed copy, as a float32 weight gets at load
        return len(self.modules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(model=GEMMA3_MODEL, max_model_len=1024, kv_cache_memory=2**30)
    joined = JoinedWeights(llm)
    prompts = make_prompts(64, 32, 512, llm.core.info.vocab_size)
    ways = {"joined blocks": True, "float32": False}
    single: dict[str, list[float]] = {name: [] for name in ways}
    offline: dict[str, list[float]] = {name: [] for name in ways}
    print(f"load before: {os.getloadavg()}; threads: {torch.get_num_threads()}")
    for r in range(args.rounds):
        for name, blocks in ways.items():
            count = joined.use(blocks)
            steps = decode_step_times(llm, steps=args.new_tokens - 1)
            single[name].append(1 / statistics.median(steps))
            offline[name].append(run_tandem(llm, prompts, args.new_tokens))
            print(
                f"  round {r + 1}: {name:<13} ({count} weights) single "
                f"{single[name][-1]:6.1f} tok/s  64 requests {offline[name][-1]:6.1f} tok/s",
                flush=True,
            )
    print(f"load after: {os.getloadavg()}")
    for label, table in (("single stream", single), ("64 mixed requests", offline)):
        print(f"{label}, tokens/s:")
        for name, values in table.items():
            print(
                f"  {name:<13} median {statistics.median(values):7.1f} "
                f"(min {min(values):.1f}, max {max(values):.1f})"
            )
        ratios = [a / b for a, b in zip(table["joined blocks"], table["float32"], strict=True)]
        print(f"  joined / float32 per round: {[f'{x:.2f}' for x in ratios]}")


if __name__ == "__main__":
    main()
