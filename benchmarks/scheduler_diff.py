"""Differential check: Tandem's scheduler against vLLM 0.12.0's, step by step.

Random traces (``sched_traces.py``: prompt lengths, max_tokens, priorities,
arrival steps, shared prefixes, small block pools that force preemption,
and in half of them a fake KV connector with sync and async loads, load
failures and delayed frees) are replayed through both schedulers with the
same config. Per step the scheduled requests and token counts, preemptions,
finishes and free-block counts are compared. vLLM runs in its own
interpreter (``baselines/vllm_scheduler_diff.py``); Tandem never imports it.

    python benchmarks/scheduler_diff.py --vllm-python /work/vllmenv/bin/python \
        --traces 2450
    python benchmarks/scheduler_diff.py --dump before.jsonl   # Tandem alone

Each trace that differs is classified by its first differing step: Tandem's
documented max_model_len and min_tokens departures, Tandem's deadlock
breaker (then by whether vLLM completed that trace), or unexplained. Run by
hand, not by the test suite.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from sched_traces import (  # noqa: E402
    SCENARIOS,
    ConnectorScript,
    RequestSpec,
    StepRecord,
    Trace,
    TraceResult,
    as_async,
    make_trace,
    replay,
)

from connectors.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole  # noqa: E402
from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.kv_cache.manager import KVCacheBlocks  # noqa: E402
from engine.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from engine.request import Request, RequestStatus  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sched.async_scheduler import AsyncScheduler  # noqa: E402
from engine.sched.output import SchedulerOutput  # noqa: E402
from engine.sched.scheduler import Scheduler  # noqa: E402

# The breaker's log line; the harness notes each release in its step.
BREAKER_MESSAGE = "to avoid a deadlock"


class ScriptedConnector(KVConnectorBase):
    """The scheduler half of a connector, answering from the trace script."""

    def __init__(self, script: ConnectorScript) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.script = script

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.script.matched(request.request_id, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.script.allocated(request.request_id, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        return self.script.finished(request.request_id, block_ids), None

    def start_load_kv(self, **kwargs: object) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: object, **kwargs: object) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class BreakerLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.notes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if BREAKER_MESSAGE in message:
            self.notes.append(f"breaker: {message}")


class TandemSide:
    def __init__(self, trace: Trace, log: BreakerLog) -> None:
        cfg = trace.config
        self.script = ConnectorScript(trace)
        self.log = log
        scheduler_class = AsyncScheduler if cfg.async_scheduling else Scheduler
        self.sched = scheduler_class(
            SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len,
                enable_chunked_prefill=cfg.chunked_prefill,
                policy="priority" if cfg.policy == "priority" else "fcfs",
                long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                async_scheduling=cfg.async_scheduling,
            ),
            CacheConfig(
                block_size=cfg.block_size,
                num_blocks=cfg.num_blocks,
                enable_prefix_caching=cfg.prefix_caching,
            ),
            connector=ScriptedConnector(self.script) if cfg.connector else None,
            log_stats=False,
        )
        # Scheduled, not yet updated: one, or two with asynchronous scheduling.
        self.pending: deque[SchedulerOutput] = deque()

    def add(self, spec: RequestSpec) -> None:
        params = SamplingParams(
            max_tokens=spec.max_tokens, min_tokens=spec.min_tokens, ignore_eos=spec.ignore_eos
        )
        self.sched.add_request(
            Request(
                spec.request_id,
                list(spec.prompt),
                params,
                eos_token_id=2,
                arrival_time=spec.arrival_time,
                priority=spec.priority,
            )
        )

    def schedule(self) -> tuple[dict[str, int], list[str]]:
        self.log.notes = []
        so = self.sched.schedule()
        self.pending.append(so)
        return dict(so.num_scheduled_tokens), list(so.preempted_req_ids)

    def computed_and_total(self, request_id: str) -> tuple[int, int]:
        request = self.sched.requests[request_id]
        return request.num_computed_tokens, request.num_tokens

    def num_output_tokens(self, request_id: str) -> int:
        return len(self.sched.requests[request_id].output_token_ids)

    def num_output_placeholders(self, request_id: str) -> int:
        return self.sched.requests[request_id].num_output_placeholders

    def update(
        self,
        sampled: dict[str, list[int]],
        finished_sending: set[str],
        finished_recving: set[str],
        invalid_block_ids: set[int],
    ) -> dict[str, str]:
        so = self.pending.popleft()
        req_ids = list(so.num_scheduled_tokens)
        kv_output = None
        if self.sched.kv_transfers.has_connector:
            kv_output = KVConnectorOutput(
                finished_sending=finished_sending,
                finished_recving=finished_recving,
                invalid_block_ids=invalid_block_ids,
            )
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            kv_connector_output=kv_output,
        )
        outputs = self.sched.update_from_output(so, output)
        return {
            o.request_id: str(o.finish_reason)
            for o in outputs.outputs
            if o.finish_reason is not None
        }

    def waiting_for_remote(self) -> list[str]:
        return [
            r.request_id
            for r in self.sched.waiting
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]

    def has_requests(self) -> bool:
        return self.sched.has_requests()

    def num_free_blocks(self) -> int:
        return self.sched.kv_cache_manager.get_num_free_blocks()

    def notes(self) -> list[str]:
        return list(self.log.notes)


def run_tandem(traces: list[Trace]) -> dict[int, TraceResult]:
    log = BreakerLog()
    sched_logger = logging.getLogger("engine.sched")
    sched_logger.addHandler(log)
    sched_logger.propagate = False  # the breaker's warnings are counted, not printed
    return {trace.seed: replay(trace, TandemSide(trace, log)) for trace in traces}


def start_vllm(
    python: str, seeds: list[int], scenarios: bool, async_scheduling: bool
) -> subprocess.Popen[str]:
    script = HERE / "baselines" / "vllm_scheduler_diff.py"
    which = ["--scenarios"] if scenarios else ["--first-seed", str(seeds[0])]
    which += ["--async-scheduling"] if async_scheduling else []
    return subprocess.Popen(
        [python, str(script), *which, "--traces", str(len(seeds))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONHASHSEED": "0"},
    )


@dataclass
class Verdict:
    kind: str
    step: int
    detail: str


def first_difference(a: list[StepRecord], b: list[StepRecord]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if (x.scheduled, x.preempted, x.finished, x.free_blocks) != (
            y.scheduled,
            y.preempted,
            y.finished,
            y.free_blocks,
        ):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(trace: Trace, tandem: TraceResult, vllm: TraceResult) -> Verdict | None:
    step = first_difference(tandem.steps, vllm.steps)
    if step is None and tandem.outcome == vllm.outcome:
        return None
    if step is None:
        step = len(tandem.steps)
    if any(s.notes for s in tandem.steps[: step + 1]):
        fired = next(i for i, s in enumerate(tandem.steps) if s.notes)
        return Verdict(f"breaker, vLLM {vllm.outcome}", step, f"breaker at step {fired}")
    if step >= min(len(tandem.steps), len(vllm.steps)):
        return Verdict("other", step, f"tandem {tandem.outcome}, vllm {vllm.outcome}")
    t, v = tandem.steps[step], vllm.steps[step]
    max_len = trace.config.max_model_len
    specs = {s.request_id: s for s in trace.requests}
    # vLLM caps a running request at max_model_len - 1 tokens: a prompt of
    # exactly max_model_len, chunked, stops one short (and never finishes).
    for rid, n, computed in v.scheduled:
        if computed + n == max_len - 1 and len(specs[rid].prompt) == max_len:
            return Verdict("max_model_len", step, f"{rid}: vLLM stops at {max_len - 1}")
    v_sched = {r: n for r, n, _ in v.scheduled}
    for rid, n, computed in t.scheduled:
        if computed + n == max_len and v_sched.get(rid, 0) < n:
            return Verdict("max_model_len", step, f"{rid}: Tandem reaches {max_len}")
    v_fin = dict(v.finished)
    for rid, reason in t.finished:
        if reason == "length" and rid not in v_fin and specs[rid].min_tokens:
            return Verdict("min_tokens", step, f"{rid} ends at max_model_len")
    return Verdict("other", step, f"tandem {t}\n      vllm   {v}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="interpreter with vllm==0.12.0 (else Tandem only)")
    parser.add_argument("--dump", type=Path, help="write Tandem's step records here (JSON lines)")
    parser.add_argument("--traces", type=int, default=2450)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=5, help="differences to print per kind")
    parser.add_argument("--show-kind", default="other", help="which kind (a prefix) to print")
    parser.add_argument("--explain", type=int, help="one trace: print both sides step by step")
    parser.add_argument(
        "--scenarios", action="store_true", help="the hand-made traces (sched_traces.SCENARIOS)"
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="both sides' AsyncScheduler, one step in flight (traces without a connector)",
    )
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Several frees in one step go in set order (as in vLLM), which
        # decides block reuse: both sides need the same string hashing.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    seeds = list(range(args.first_seed, args.first_seed + args.traces))
    if args.explain is not None:
        seeds = [args.explain]
    traces = list(SCENARIOS.values()) if args.scenarios else [make_trace(s) for s in seeds]
    if args.async_scheduling:
        traces = [as_async(t) for t in traces]
    seeds = [trace.seed for trace in traces]
    t0 = time.monotonic()
    proc = (
        start_vllm(args.vllm_python, seeds, args.scenarios, args.async_scheduling)
        if args.vllm_python
        else None
    )
    tandem = run_tandem(traces)
    if args.dump is not None:
        # Before/after a refactor of Tandem alone: the dumps must be equal.
        with args.dump.open("w") as f:
            f.writelines(json.dumps(tandem[seed].to_json()) + "\n" for seed in seeds)
    if proc is None:
        outcomes = Counter(r.outcome.split(":")[0] for r in tandem.values())
        print(f"{len(seeds)} traces through Tandem: {dict(outcomes)}")
        return
    vllm_out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the vLLM side failed with exit code {proc.returncode}")
    lines = vllm_out.splitlines()
    vllm = {r.seed: r for r in (TraceResult.from_json(json.loads(line)) for line in lines)}
    if args.explain is not None or args.scenarios:
        for name, trace in zip(SCENARIOS if args.scenarios else ["trace"], traces, strict=False):
            print(f"--- {name}")
            explain(trace, tandem[trace.seed], vllm[trace.seed])
        return
    report({t.seed: t for t in traces}, tandem, vllm, args.show, args.show_kind)
    print(f"({time.monotonic() - t0:.0f} s)")


def explain(trace: Trace, tandem: TraceResult, vllm: TraceResult) -> None:
    print(trace.config)
    for spec in trace.requests:
        print(
            f"  {spec.request_id}: prompt {len(spec.prompt)} max_tokens {spec.max_tokens} "
            f"min_tokens {spec.min_tokens} priority {spec.priority} arrives {spec.arrival_step} "
            f"external {spec.external_tokens} async {spec.load_async} "
            f"delay_free {spec.delay_free}"
        )
    print(f"outcomes: tandem {tandem.outcome}, vllm {vllm.outcome}")
    num_steps = max(len(tandem.steps), len(vllm.steps))
    differ = first_difference(tandem.steps, vllm.steps)
    end = num_steps if differ is None else min(num_steps, differ + 6)
    for i in range(end):
        t = tandem.steps[i] if i < len(tandem.steps) else None
        v = vllm.steps[i] if i < len(vllm.steps) else None
        print(f"{i:4d} T {t}")
        if v != t or (t is not None and t.notes):
            print(f"     V {v}")
    if end < num_steps:
        print(f"     ... ({num_steps} steps)")


def report(
    traces: dict[int, Trace],
    tandem: dict[int, TraceResult],
    vllm: dict[int, TraceResult],
    show: int,
    show_kind: str,
) -> None:
    kinds: Counter[str] = Counter()
    shown = 0
    num_steps = num_connector = 0
    for seed, trace in traces.items():
        num_steps += len(vllm[seed].steps)
        num_connector += trace.config.connector
        verdict = classify(trace, tandem[seed], vllm[seed])
        kinds["identical" if verdict is None else verdict.kind] += 1
        if verdict is not None and verdict.kind.startswith(show_kind) and shown < show:
            shown += 1
            print(f"seed {seed}: differs at step {verdict.step}: {verdict.detail}")
    outcomes = Counter(r.outcome.split(":")[0] for r in tandem.values())
    print(
        f"{len(traces)} traces ({num_steps} vLLM steps; {num_connector} with a KV connector); "
        f"Tandem outcomes: {dict(outcomes)}"
    )
    for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}  {kind}")


if __name__ == "__main__":
    main()
