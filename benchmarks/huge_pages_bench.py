"""Single-stream decode with the quantized weights on 2 MiB pages against 4 KiB pages.

The engine moves its quantized weights into one buffer advised
MADV_HUGEPAGE at load (kernels/huge_pages.py). This loads the default model
once per configuration and, in the same process, moves the weights between
that buffer and ordinary 4 KiB-page copies (Tensor.set_, as the loader
does), interleaving the two (A, B, A, B): a decode step of one request
(64-token prompt, 128 steps), median per round. Prints the ratio of
tokens/s per round, the median with min/max, and the 1-minute load
average before and after (2 cores: a foreign busy process halves
everything).

    .venv/bin/python benchmarks/huge_pages_bench.py --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import decode_step_times  # noqa: E402

from engine.llm import LLM  # noqa: E402
from kernels.huge_pages import move_to_huge_pages  # noqa: E402


def anon_huge_kib() -> int:
    """This process's memory on transparent huge pages, KiB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def to_small_pages(tensors: list[torch.Tensor]) -> None:
    """Each tensor into its own ordinary allocation (4 KiB pages)."""
    with torch.inference_mode():  # the loader's weights are inference tensors
        for t in tensors:
            copy = t.clone()
            t.set_(copy.untyped_storage(), 0, copy.shape, copy.stride())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load before: {os.getloadavg()[0]:.2f}")
    configs: dict[str, dict[str, Any]] = {
        "q4_1": {},
        "q4_1 + int8 act": {"int8_activations": True},
    }
    for name, kwargs in configs.items():
        llm = LLM(max_model_len=1024, **kwargs)
        model: Any = llm.core.worker.runner.model
        packed = [w.packed for w in model.quantized_weights()]
        ratios: list[float] = []
        for r in range(args.rounds):
            rates = {}
            for placement in ("2 MiB", "4 KiB"):
                if placement == "2 MiB":
                    move_to_huge_pages(packed)
                else:
                    to_small_pages(packed)
                huge = anon_huge_kib()
                rates[placement] = 1 / statistics.median(decode_step_times(llm, args.steps))
                print(
                    f"  {name:<16} round {r + 1} {placement} pages: {rates[placement]:6.1f} tok/s "
                    f"(process on huge pages: {huge / 1024:.0f} MiB)",
                    flush=True,
                )
            ratios.append(rates["2 MiB"] / rates["4 KiB"])
        print(
            f"{name}: 2 MiB / 4 KiB pages, single-stream tok/s: median "
            f"{statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})",
            flush=True,
        )
        del llm
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
