"""A scripted stand-in for EngineCore, and an AsyncEngine around it.

For unit tests of the async front door (and the servicer over it) without a
model: the core emits token 42 for every live request each step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_thread import EngineThread
from engine.models.loader import load_tokenizer, resolve_model
from engine.outputs import EngineCoreOutput, EngineCoreOutputs
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.stats import SchedulerStats
from engine.worker.worker import WorkerInfo


@dataclass
class ScriptedCore:
    """Emits token 42 for every live request each step; finishes a request
    after max_tokens; raises on step `fail_at` if set."""

    fail_at: int | None = None
    live: dict[str, Request] = field(default_factory=dict)
    aborted: list[tuple[str, RequestStatus]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    # Ids the scheduler still holds (finished, KV kept for a remote decode).
    held: set[str] = field(default_factory=set)
    # With hold_kv, a finished request's KV stays held (in held_kv) until
    # released, as a prefill pod's for its decode pod.
    hold_kv: bool = False
    held_kv: set[str] = field(default_factory=set)
    steps: int = 0
    engine_id: str = "scripted-engine"
    # What reset_prefix_cache answers (the real one: False while blocks are in use).
    cache_resettable: bool = True
    config: EngineConfig = field(default_factory=EngineConfig)
    info: WorkerInfo = field(
        default_factory=lambda: WorkerInfo(
            model_path=resolve_model(None),
            model_name="stand-in",
            architecture="LlamaForCausalLM",
            vocab_size=49152,
            max_model_len=64,
            num_blocks=8,
            eos_token_id=None,
        )
    )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.held:  # as the scheduler refuses it
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.live[request.request_id] = request

    def abort_requests(self, ids: list[str], status: RequestStatus) -> None:
        for rid in ids:
            if self.live.pop(rid, None) is not None:
                self.aborted.append((rid, status))

    def release_held_kv(self, ids: list[str]) -> None:
        self.released.extend(ids)
        self.held_kv.difference_update(ids)

    def connector_health(self) -> str | None:
        return None

    def reset_prefix_cache(self) -> bool:
        return self.cache_resettable and not self.live

    def has_work(self) -> bool:
        return bool(self.live or self.held_kv)

    # A connector that polls while idle, when set (see idle_polls).
    idle_poll_seconds: float | None = None
    idle_polls = 0

    def poll_idle(self) -> None:
        if self.idle_poll_seconds is None:
            raise AssertionError("poll_idle without idle_poll_seconds")
        self.idle_polls += 1

    def step(self) -> EngineCoreOutputs:
        # A real step's forward releases the GIL for most of its time.
        time.sleep(0.001)
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("boom")
        outs = []
        for rid, req in list(self.live.items()):
            req.append_output_token_id(42)
            done = req.num_output_tokens >= req.sampling_params.max_tokens
            outs.append(EngineCoreOutput(rid, [42], FinishReason.LENGTH if done else None))
            if done:
                del self.live[rid]
                if self.hold_kv:
                    self.held_kv.add(rid)
        return EngineCoreOutputs(outs, scheduler_stats=self._stats())

    def stats_only(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(scheduler_stats=self._stats())

    def _stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.live), num_held_requests=len(self.held_kv))

    def shutdown(self) -> None:
        pass


async def start_engine(core: ScriptedCore, **kwargs: Any) -> AsyncEngine:
    thread, _ = await EngineThread.launch(lambda: core)  # type: ignore[arg-type,return-value]
    tokenizer = load_tokenizer(resolve_model(None))
    return AsyncEngine(thread, core, tokenizer, **kwargs)  # type: ignore[arg-type]


def make_request(engine: AsyncEngine, rid: str, max_tokens: int = 3) -> Request:
    inputs = engine.front.inputs
    return inputs.make_request(
        rid, inputs.process_prompt([1, 2, 3]), SamplingParams(max_tokens=max_tokens)
    )
