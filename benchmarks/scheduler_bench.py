"""CPU time of one scheduler step with N running decode requests.

One step = ``schedule()`` + ``update_from_output()`` with a prebuilt model
output (one sampled token per request), prefix caching and stats on, the
garbage collector frozen after set-up (as vLLM's engine does). Prompt lengths
vary so block boundaries (hashing and caching a full block) are spread over
the steps, as in real traffic.

    python benchmarks/scheduler_bench.py                 # Tandem alone
    python benchmarks/scheduler_bench.py --vllm-python /tmp/vllmenv/bin/python

With ``--vllm-python`` the same workload runs through vLLM's own v1
scheduler in that interpreter (benchmarks/baselines/vllm_scheduler_step.py),
interleaved with Tandem's runs (A, B, A, B ...), and the ratio of medians is
printed. Tandem itself never imports vllm.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from workload import BLOCK_SIZE, limits, make_prompts  # noqa: E402

from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.outputs import ModelRunnerOutput  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sched.scheduler import Scheduler  # noqa: E402


def build_scheduler(prompts: list[list[int]], steps: int) -> Scheduler:
    n = len(prompts)
    max_len, num_blocks, budget = limits(n, steps)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=budget, max_model_len=max_len),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
    )
    params = SamplingParams(max_tokens=max_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"req-{i}", prompt, params, eos_token_id=0))
    return sched


def fake_output(sched: Scheduler, req_ids: list[str]) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
    )


def warm_to_decode(sched: Scheduler) -> ModelRunnerOutput:
    """Run prefills until every request decodes; return a reusable output."""
    while True:
        out = sched.schedule()
        req_ids = list(out.num_scheduled_tokens)
        sampled = [
            [7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
            for r in req_ids
        ]
        sched.update_from_output(
            out, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
        )
        if not sched.waiting and all(v == 1 for v in out.num_scheduled_tokens.values()):
            return fake_output(sched, req_ids)


def time_tandem(n: int, steps: int) -> list[float]:
    """Microseconds per step for ``steps`` steps."""
    sched = build_scheduler(make_prompts(n), steps)
    output = warm_to_decode(sched)
    gc.collect()
    gc.freeze()
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            so = sched.schedule()
            sched.update_from_output(so, output)
            times.append((time.perf_counter_ns() - t0) / 1000)
    finally:
        gc.unfreeze()
    if len(so.num_scheduled_tokens) != n:
        raise RuntimeError(f"expected {n} decodes per step, got {len(so.num_scheduled_tokens)}")
    return times


def time_vllm(python: str, n: int, steps: int) -> list[float]:
    script = Path(__file__).resolve().parent / "baselines" / "vllm_scheduler_step.py"
    proc = subprocess.run(
        [python, str(script), "--n", str(n), "--steps", str(steps)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    times: list[float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return times


def summarize(label: str, runs: list[float]) -> str:
    return (
        f"{label:>7}: median {statistics.median(runs):8.0f} us/step "
        f"(min {min(runs):.0f}, max {max(runs):.0f}, {len(runs)} runs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,4096", help="running decodes per step")
    parser.add_argument("--steps", type=int, default=64, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size")
    parser.add_argument("--vllm-python", help="interpreter with vllm==0.12.0 for the baseline")
    parser.add_argument("--quick", action="store_true", help="one small round (demo)")
    args = parser.parse_args()
    sizes = [256] if args.quick else [int(s) for s in args.sizes.split(",")]
    rounds = 1 if args.quick else args.rounds
    print(f"load average at start: {os.getloadavg()}")
    for n in sizes:
        tandem_medians: list[float] = []
        vllm_medians: list[float] = []
        for _ in range(rounds):
            if args.vllm_python:
                vllm_medians.append(statistics.median(time_vllm(args.vllm_python, n, args.steps)))
            tandem_medians.append(statistics.median(time_tandem(n, args.steps)))
        print(f"N={n} running decodes, {args.steps} steps per run")
        print(summarize("tandem", tandem_medians))
        if vllm_medians:
            print(summarize("vllm", vllm_medians))
            ratio = statistics.median(tandem_medians) / statistics.median(vllm_medians)
            print(f"  tandem / vllm = {ratio:.2f}")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
