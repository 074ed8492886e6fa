"""Baseline for benchmarks/scheduler_bench.py: vLLM 0.12.0's own v1 scheduler
on the same workload. Run only by that script, in an interpreter that has
vllm installed (``--vllm-python``); Tandem never imports this file or vllm.

Prints one JSON line: microseconds per step.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm.config import SchedulerConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm_stub import make_scheduler
from workload import BLOCK_SIZE, limits, make_prompts

logging.disable(logging.WARNING)


class NoStructuredOutput:
    """The real manager's answer for requests without a grammar (a plain
    object: a mock's call overhead would slow the baseline unfairly)."""

    def should_advance(self, request: object) -> bool:
        return False


def build(n: int, steps: int) -> tuple[object, object]:
    max_len, num_blocks, budget = limits(n, steps)
    sched = make_scheduler(
        SchedulerConfig(
            max_num_seqs=n,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            is_encoder_decoder=False,
        ),
        max_model_len=max_len,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        prefix_caching=True,
        structured_output_manager=NoStructuredOutput(),
        log_stats=True,
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    params = SamplingParams(max_tokens=max_len, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(n)):
        sched.add_request(
            Request(f"req-{i}", prompt, params, None, eos_token_id=0, block_hasher=hasher)
        )
    return sched, warm(sched)


def runner_output(req_ids: list[str], sampled: list[list[int]]) -> object:
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def warm(sched: object) -> object:
    while True:
        out = sched.schedule()  # type: ignore[attr-defined]
        req_ids = list(out.num_scheduled_tokens)
        reqs = sched.requests  # type: ignore[attr-defined]
        sampled = [
            [7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in req_ids
        ]
        sched.update_from_output(out, runner_output(req_ids, sampled))  # type: ignore[attr-defined]
        if not sched.waiting and all(v == 1 for v in out.num_scheduled_tokens.values()):  # type: ignore[attr-defined]
            return runner_output(req_ids, [[7] for _ in req_ids])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    sched, output = build(args.n, args.steps)
    gc.collect()
    gc.freeze()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter_ns()
        so = sched.schedule()  # type: ignore[attr-defined]
        sched.update_from_output(so, output)  # type: ignore[attr-defined]
        times.append((time.perf_counter_ns() - t0) / 1000)
    if len(so.num_scheduled_tokens) != args.n:
        raise RuntimeError(f"expected {args.n} decodes, got {len(so.num_scheduled_tokens)}")
    print(json.dumps(times))


if __name__ == "__main__":
    main()
