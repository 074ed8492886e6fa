"""Offline throughput of Tandem's LLM API against transformers' generate().

Workload: 64 requests with prompts of 32-512 random tokens and 128 output
tokens each (EOS ignored), on the default model. Tandem gets all 64 at once;
transformers runs static batches of ``--hf-batch-size`` with left padding on
the same prompts (``--hf-batches`` of them: one batch of 16 already takes
~45 s here). Runs are interleaved (HF, Tandem, HF, Tandem, ...) and the
script prints medians with min/max, so outside load hits both alike.

It also times a single-stream decode step against the time it takes to read
the weights once from memory (read bandwidth measured here, in this run).

    .venv/bin/python benchmarks/offline_throughput.py            # 2 rounds
    .venv/bin/python benchmarks/offline_throughput.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping

import torch

from engine.llm import LLM
from engine.models.loader import GEMMA3_MODEL, resolve_model
from engine.sampling_params import SamplingParams


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids, where the special tokens live.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_tandem(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Every round must prefill for real: forget the previous round's prompts.
    llm.core.scheduler.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def run_hf(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, pad: int) -> float:
    generated = 0
    start = time.perf_counter()
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    generated += (out.shape[1] - longest) * len(prompts)
    return float(generated / (time.perf_counter() - start))


def read_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s for streaming reads (a sum over a tensor larger than caches)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / min(times)


def decode_step_times(llm: LLM, steps: int = 64) -> list[float]:
    """Seconds of each of `steps` decode steps with a single running request."""
    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    request = llm.inputs.make_request("bench-decode", llm.inputs.process_prompt([100] * 64), params)
    core.add_request(request)
    core.step()  # prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    while core.has_work():
        core.step()
    return times


def median_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    """The median of `repeats` timed calls of fn, in milliseconds, after one
    untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def summary(values: list[float]) -> str:
    return (
        f"median {statistics.median(values):7.2f}  (min {min(values):.2f}, max {max(values):.2f})"
    )


def interleave(rounds: int, runs: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name, fn in runs.items():
            value = fn()
            results[name].append(value)
            print(f"  round {r + 1}: {name:<28} {value:7.1f} output tok/s", flush=True)
    return results


def switched_engine(doc: str) -> tuple[argparse.Namespace, LLM]:
    """The A/B benchmarks' common start (decode_stack_bench, joined_qkv_bench,
    kquant_int8_bench): ``--model`` (Gemma 3 270M unless told), ``--rounds``
    and ``--new-tokens``, and one engine on the default settings."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default=GEMMA3_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    return args, LLM(model=args.model, max_model_len=1024, kv_cache_memory=2**30)


def switched_runs(
    llm: LLM,
    ways: Mapping[str, Callable[[], int]],
    rounds: int,
    new_tokens: int,
    prompts: list[list[int]],
) -> None:
    """One engine run several ways, interleaved (A, B, A, B): each way's
    callable switches the engine (its weights, its decode path) and says
    how many parts it switched.
    Prints single-stream tokens/s (1 / the median decode step) and the
    `prompts`' output tokens/s per round, medians with min and max, the
    first way over the second per round, and the load before and after."""
    single: dict[str, list[float]] = {name: [] for name in ways}
    offline: dict[str, list[float]] = {name: [] for name in ways}
    width = max(len(name) for name in ways)
    print(f"load before: {os.getloadavg()}; threads: {torch.get_num_threads()}")
    for r in range(rounds):
        for name, switch in ways.items():
            count = switch()
            steps = decode_step_times(llm, steps=new_tokens - 1)
            single[name].append(1 / statistics.median(steps))
            offline[name].append(run_tandem(llm, prompts, new_tokens))
            print(
                f"  round {r + 1}: {name:<{width}} ({count} switched) single "
                f"{single[name][-1]:6.1f} tok/s  {len(prompts)} requests "
                f"{offline[name][-1]:6.1f} tok/s",
                flush=True,
            )
    print(f"load after: {os.getloadavg()}")
    first, second = ways
    for label, table in (("single stream", single), (f"{len(prompts)} mixed requests", offline)):
        print(f"{label}, tokens/s:")
        for name, values in table.items():
            print(
                f"  {name:<{width}} median {statistics.median(values):7.1f} "
                f"(min {min(values):.1f}, max {max(values):.1f})"
            )
        ratios = [a / b for a, b in zip(table[first], table[second], strict=True)]
        print(f"  {first} / {second} per round: {[f'{x:.2f}' for x in ratios]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-batches", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.max_tokens, args.hf_batch_size, args.rounds = 8, 16, 4, 1
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    path = resolve_model(None)
    llm = LLM(max_model_len=1024)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()  # type: ignore[no-untyped-call]
    prompts = make_prompts(args.num_requests, 32, 512, llm.core.info.vocab_size)
    hf_prompts = prompts[: args.hf_batch_size * args.hf_batches]
    pad = int(llm.core.info.eos_token_id or 0)

    def hf_run() -> float:
        rates = []
        for i in range(0, len(hf_prompts), args.hf_batch_size):
            batch = hf_prompts[i : i + args.hf_batch_size]
            rates.append(run_hf(hf, batch, args.max_tokens, pad))
        return statistics.mean(rates)

    print(
        f"workload: {args.num_requests} prompts of 32-512 tokens, {args.max_tokens} output "
        f"tokens each; transformers on {len(hf_prompts)} of them in static batches of "
        f"{args.hf_batch_size}; torch threads {args.threads}"
    )
    results = interleave(
        args.rounds,
        {
            f"transformers generate (bs {args.hf_batch_size})": hf_run,
            "tandem LLM.generate": lambda: run_tandem(llm, prompts, args.max_tokens),
        },
    )
    names = list(results)
    for name in names:
        print(f"{name:<30} {summary(results[name])} output tok/s")
    ratios = [b / a for a, b in zip(results[names[0]], results[names[1]], strict=True)]
    print(f"tandem / transformers (per round): {[f'{r:.2f}' for r in ratios]}")

    weight_bytes = llm.core.worker.loaded.model.weight_bytes
    # Bandwidth and steps alternate so outside load hits both alike; the
    # bandwidth is each round's best read, the step each round's median.
    ratios = []
    for r in range(args.rounds):
        bandwidth = read_bandwidth()
        read_time = weight_bytes / bandwidth
        times = decode_step_times(llm)
        step, best = statistics.median(times), min(times)
        ratios.append(step / read_time)
        print(
            f"  round {r + 1}: read bandwidth {bandwidth / 1e9:.1f} GB/s -> weights "
            f"({weight_bytes / 1e6:.0f} MB) read in {read_time * 1e3:.1f} ms; single-stream "
            f"decode step median {step * 1e3:.1f} ms (best {best * 1e3:.1f}) = "
            f"{step / read_time:.2f}x the read (best {best / read_time:.2f}x)",
            flush=True,
        )
    print(f"single-stream decode step / weight read: {summary(ratios)}x")


if __name__ == "__main__":
    main()
