"""One KV cache dtype against another (``--kv-cache-dtype``).

Decode over long contexts, where attention reads the most cache: 1 and 16
requests (``--requests``) with prompts of ``--prompt`` random tokens, 128
output tokens each (greedy, EOS ignored), on the default model. Both
engines live in this process and run alternately (baseline, other,
baseline, ...); the prefix cache is reset before each run. Reports decode
tokens/s (the requests over the median time of the runner's steps in which
every request decodes: prefill and scheduling left out) and the ratio per
round. Float activations unless
``--int8-activations`` (the default path's).

    .venv/bin/python benchmarks/kv_cache_dtype_bench.py --rounds 3
    .venv/bin/python benchmarks/kv_cache_dtype_bench.py --dtypes bfloat16 int8 \
        --int8-activations --requests 16 64
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from engine.llm import LLM  # noqa: E402
from engine.outputs import ModelRunnerOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sched.output import SchedulerOutput  # noqa: E402


def decode_rate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Decode tokens/s: the requests over the median time of the model
    runner's steps in which every request decodes one token (prefill steps,
    and the scheduler's time, are left out)."""
    llm.core.scheduler.reset_prefix_cache()
    worker = llm.core.worker
    execute = worker.execute_model
    times: list[float] = []

    def timed(so: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        out = execute(so)
        if so.total_num_scheduled_tokens == len(prompts) == len(so.num_scheduled_tokens):
            times.append(time.perf_counter() - start)
        return out

    worker.execute_model = timed  # type: ignore[method-assign,assignment]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del worker.execute_model  # the class's method again
    return len(prompts) / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=1536)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs=2, default=["float32", "bfloat16"], metavar="DTYPE")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--int8-activations", action="store_true")
    args = parser.parse_args()
    base, other = args.dtypes
    most = max(args.requests)
    engines = {
        # The same activations on both: the cache's dtype is all that differs.
        dtype: LLM(
            max_model_len=2048,
            kv_cache_dtype=dtype,
            int8_activations=args.int8_activations,
            max_num_batched_tokens=8192,
            max_num_seqs=max(most, 16),
            # Room for every request at once in float32 (the default
            # model: 30 layers, K and V, 3 heads of 64).
            kv_cache_memory=max(
                2**30, most * (args.prompt + args.max_tokens + 16) * 30 * 2 * 3 * 64 * 4
            ),
        )
        for dtype in (base, other)
    }
    vocab = engines[base].core.info.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt)] for _ in range(most)]
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for n in args.requests:
        rates: dict[str, list[float]] = {d: [] for d in engines}
        for r in range(args.rounds):
            for dtype, llm in engines.items():
                load = os.getloadavg()[0]
                rate = decode_rate(llm, prompts[:n], args.max_tokens)
                rates[dtype].append(rate)
                print(f"  {n:>2} req round {r + 1} {dtype:<8} {rate:7.1f} tok/s  (load {load:.2f})")
        ratios = [b / a for a, b in zip(rates[base], rates[other], strict=True)]
        for dtype, values in rates.items():
            print(
                f"{n:>2} req {dtype:<8} median {statistics.median(values):7.1f} tok/s "
                f"(min {min(values):.1f}, max {max(values):.1f})"
            )
        print(f"{n:>2} req {other} / {base} per round: {[f'{x:.3f}' for x in ratios]}")


if __name__ == "__main__":
    main()
