"""A random draw per row: the exponential race against the compiled inverse-CDF draw.

The sampler's last op for rows with temperature > 0 (kernels/sampling.py):
the race draws one exponential per vocabulary entry (torch's exponential_),
the kernel one uniform per row. Timed on softmaxed random logits of a
decode batch (rows x vocab), interleaved A, B, A, B, in one process; the
1-minute load average before and after. Nothing is asserted.

``--engine`` also runs the default model end to end with temperature 1.0
(64 requests of 32-token prompts, 128 output tokens each, then one request
alone), its sampler switched between the two draws per round.

    .venv/bin/python benchmarks/sampling_bench.py --rounds 5 --engine
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import median_ms  # noqa: E402

from kernels import sampling  # noqa: E402


def _print_medians(table: dict[str, list[float]], unit: str, digits: int) -> None:
    for name, values in table.items():
        print(
            f"  {name:<20} {statistics.median(values):8.{digits}f} {unit}"
            f"(min {min(values):.{digits}f}, max {max(values):.{digits}f})"
        )


def _ops(probs: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each way on a fresh copy (both write into their input's copy)."""
    return {
        "exponential race": lambda: sampling.exponential_race(probs.clone(), {}),
        "inverse CDF kernel": lambda: sampling.draw(probs.clone(), {}),
        "(the clone alone)": probs.clone,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--vocabs", default="49152,262144", help="SmolLM2's, Gemma 3's")
    parser.add_argument("--engine", action="store_true", help="also the default model end to end")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"load before: {os.getloadavg()[0]:.2f}")
    for vocab in map(int, args.vocabs.split(",")):
        for rows in map(int, args.rows.split(",")):
            probs = (torch.randn(rows, vocab) * 3).softmax(-1)
            ways = _ops(probs)
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(args.rounds):
                for name, fn in ways.items():
                    times[name].append(median_ms(fn))
            print(f"{rows} rows x {vocab}:")
            _print_medians(times, "ms ", 3)
            ratios = [
                a / b
                for a, b in zip(times["exponential race"], times["inverse CDF kernel"], strict=True)
            ]
            print(
                f"  race / kernel per round: median {statistics.median(ratios):.1f}x "
                f"(min {min(ratios):.1f}, max {max(ratios):.1f})"
            )
    if args.engine:
        _engine(args.rounds)
    print(f"load after: {os.getloadavg()[0]:.2f}")


def _engine(rounds: int) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.worker import sampler

    llm = LLM(max_model_len=1024)
    params = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True)
    prompts = [[100 + (7 * i + j) % 5000 for j in range(32)] for i in range(64)]
    ways = {"exponential race": sampling.exponential_race, "inverse CDF kernel": sampling.draw}
    rates: dict[str, dict[str, list[float]]] = {
        label: {name: [] for name in ways} for label in ("64 requests", "1 request")
    }
    for _ in range(rounds):
        for name, fn in ways.items():
            setattr(sampler, "draw", fn)  # noqa: B010 (the sampler looks it up at each call)
            for label, batch in (("64 requests", prompts), ("1 request", prompts[:1])):
                start = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                tokens = sum(len(o.token_ids) for o in outs)
                rates[label][name].append(tokens / (time.perf_counter() - start))
    setattr(sampler, "draw", sampling.draw)  # noqa: B010
    for label, table in rates.items():
        print(f"default model, temperature 1.0, {label}, output tok/s:")
        _print_medians(table, "", 1)
        ratios = [
            b / a
            for a, b in zip(table["exponential race"], table["inverse CDF kernel"], strict=True)
        ]
        print(f"  kernel / race per round: {[f'{r:.2f}' for r in ratios]}")


if __name__ == "__main__":
    main()
