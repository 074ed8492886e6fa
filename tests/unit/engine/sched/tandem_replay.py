"""Tandem's side of the differential check against vLLM 0.12.0's scheduler.

The random traces (``sched_traces.py``) replayed through Tandem's
``Scheduler``, and the classification of a trace whose decisions differ from
vLLM's. Shared by ``benchmarks/scheduler_diff.py`` (which runs vLLM's side
in its own interpreter) and ``test_vllm_traces.py`` (which replays against
vLLM's decisions recorded in ``data/``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import sys
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache.manager import KVCacheBlocks
from engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from engine.outputs import KVConnectorOutput, ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams
from engine.sched.async_scheduler import AsyncScheduler
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from tests.unit.engine.sched.sched_traces import (
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
        self.script.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        return self.script.finished(request.request_id, block_ids), None

    def start_load_kv(self, **kwargs: object) -> None:
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
                options=RequestOptions(priority=spec.priority),
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
    """Each trace through Tandem, by seed (the breaker's releases noted in
    their steps; its warnings counted, not printed)."""
    log = BreakerLog()
    sched_logger = logging.getLogger("engine.sched")
    propagate = sched_logger.propagate
    sched_logger.addHandler(log)
    sched_logger.propagate = False
    try:
        return {trace.seed: replay(trace, TandemSide(trace, log)) for trace in traces}
    finally:
        sched_logger.removeHandler(log)
        sched_logger.propagate = propagate


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
    # An asynchronous load that ends inside a block: vLLM counts the whole
    # last block as loaded, Tandem only the tokens it delivered (issue 38).
    bs = trace.config.block_size
    v_computed = {r: c for r, _, c in v.scheduled}
    for rid, _, computed in t.scheduled:
        spec = specs[rid]
        if not (spec.load_async and spec.external_tokens) or rid not in v_computed:
            continue
        if computed < v_computed[rid] <= -(-computed // bs) * bs:
            return Verdict("async load", step, f"{rid}: Tandem {computed}, vLLM {v_computed[rid]}")
    return Verdict("other", step, f"tandem {t}\n      vllm   {v}")


# vLLM's decisions recorded once (``scheduler_diff.py --record``) and
# replayed by test_vllm_traces.py: one JSON line per trace.
MODES = ("sync", "async", "scenario")


def recorded_trace(mode: str, seed: int) -> Trace:
    """The trace a record names: a random trace run synchronously, the same
    one with asynchronous scheduling, or a hand-made scenario."""
    if mode == "scenario":
        return next(t for t in SCENARIOS.values() if t.seed == seed)
    trace = make_trace(seed)
    return as_async(trace) if mode == "async" else trace


def trace_digest(trace: Trace) -> str:
    """Ties a record to the trace it was made from: make_trace changing
    would leave the recorded decisions answering another trace."""
    text = json.dumps(asdict(trace), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def record(mode: str, trace: Trace, tandem: TraceResult, vllm: TraceResult) -> dict[str, Any]:
    verdict = classify(trace, tandem, vllm)
    return {
        "mode": mode,
        "seed": trace.seed,
        "trace": trace_digest(trace),
        "verdict": None if verdict is None else verdict.kind,
        "step": None if verdict is None else verdict.step,
        "vllm": vllm.to_json(),
    }


@dataclass
class Replayed:
    """One recorded trace replayed through Tandem now."""

    mode: str
    seed: int
    recorded: str | None  # the verdict at recording (None: identical)
    recorded_step: int | None
    verdict: str | None  # the verdict now
    step: int | None
    detail: str


def replay_recorded(path: Path) -> list[Replayed]:
    """Replays each recorded trace through Tandem and classifies it against
    vLLM's recorded decisions. Needs PYTHONHASHSEED=0, as at recording."""
    with gzip.open(path, "rt") as f:
        records = [json.loads(line) for line in f]
    out = []
    for rec in records:
        trace = recorded_trace(rec["mode"], rec["seed"])
        if trace_digest(trace) != rec["trace"]:
            out.append(
                Replayed(
                    rec["mode"],
                    rec["seed"],
                    rec["verdict"],
                    rec["step"],
                    "trace changed",
                    None,
                    "sched_traces.py makes another trace for this seed now: re-record",
                )
            )
            continue
        tandem = run_tandem([trace])[trace.seed]
        verdict = classify(trace, tandem, TraceResult.from_json(rec["vllm"]))
        out.append(
            Replayed(
                rec["mode"],
                rec["seed"],
                rec["verdict"],
                rec["step"],
                None if verdict is None else verdict.kind,
                None if verdict is None else verdict.step,
                "" if verdict is None else verdict.detail,
            )
        )
    return out


if __name__ == "__main__":
    # test_vllm_traces.py runs this under PYTHONHASHSEED=0.
    results = replay_recorded(Path(sys.argv[1]))
    print(json.dumps([asdict(r) for r in results]))
