"""Drive a real Scheduler with a scripted fake model (unit tests only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import EngineCoreOutput, KVConnectorOutput, ModelRunnerOutput
from engine.request import Request
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.stats import SchedulerStats

EOS = 2


def make_scheduler(
    *,
    block_size: int = 16,
    num_blocks: int = 100,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    prefix_caching: bool = True,
    chunked_prefill: bool = True,
    policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    connector: object = None,
    kv_load_failure_policy: str = "recompute",
    max_loras: int = 0,
    group_windows: tuple[int | None, ...] = (None,),
    **sched_kwargs: object,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked_prefill,
            policy=policy,  # type: ignore[arg-type]
            long_prefill_token_threshold=long_prefill_token_threshold,
            **sched_kwargs,  # type: ignore[arg-type]
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=prefix_caching,
            group_windows=group_windows,
        ),
        connector=connector,  # type: ignore[arg-type]
        kv_load_failure_policy=kv_load_failure_policy,
        max_loras=max_loras,
    )


def make_request(
    request_id: str,
    prompt: list[int] | int,
    *,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float | None = None,
    **params: object,
) -> Request:
    # An int prompt is distinct per request id, so no accidental prefix hits.
    base = 10_000 * (1 + int(request_id.lstrip("r") or 0))
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_id=EOS,
        options=RequestOptions(priority=priority),
        arrival_time=float(arrival_time) if arrival_time is not None else 0.0,
    )


def default_token(request: Request) -> int:
    """A deterministic non-EOS token depending on the request and position."""
    return 1000 + 7 * len(request.output_token_ids) + int(request.request_id.lstrip("r") or 0)


@dataclass
class StepResult:
    sched_out: SchedulerOutput
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None

    @property
    def scheduled(self) -> dict[str, int]:
        return dict(self.sched_out.num_scheduled_tokens)

    def tokens(self, req_id: str) -> list[int]:
        return [t for o in self.outputs if o.request_id == req_id for t in o.new_token_ids]

    def finished(self) -> dict[str, str]:
        return {o.request_id: str(o.finish_reason) for o in self.outputs if o.finish_reason}


def step(
    sched: Scheduler,
    sample: Callable[[Request], int | list[int]] = default_token,
    kv_connector_output: KVConnectorOutput
    | Callable[[SchedulerOutput], KVConnectorOutput | None]
    | None = None,
) -> StepResult:
    """schedule() then update_from_output() with a fake model: a request
    samples when the step brings it level with its tokens. A callable
    `kv_connector_output` sees the step's schedule (e.g. to fail its loads)."""
    so = sched.schedule()
    if callable(kv_connector_output):
        kv_connector_output = kv_connector_output(so)
    req_ids = list(so.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in req_ids:
        req = sched.requests[rid]
        if req.num_computed_tokens >= req.num_tokens:
            tok = sample(req)
            sampled.append(tok if isinstance(tok, list) else [tok])
        else:
            sampled.append([])
    mro = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_connector_output,
    )
    outs = sched.update_from_output(so, mro)
    return StepResult(so, list(outs.outputs), outs.scheduler_stats)


def run_to_completion(
    sched: Scheduler,
    sample: Callable[[Request], int | list[int]] = default_token,
    max_steps: int = 10_000,
) -> tuple[dict[str, list[int]], dict[str, str], list[StepResult]]:
    """Step until nothing is left. Returns (tokens, finish reasons, steps)."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        res = step(sched, sample)
        steps.append(res)
        for o in res.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = str(o.finish_reason)
    else:
        raise AssertionError("requests did not finish")
    return tokens, reasons, steps


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.get_num_free_blocks()
