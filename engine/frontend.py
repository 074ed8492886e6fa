"""FrontEnd: what LLM and the service's AsyncEngine share around one core.

Input processing (``inputs``: validation, tokenizing, chat templates, the
Request), output processing (detokenizing, stop strings, logprob text) and
the engine's status summed from its steps. ``LLM`` drives it synchronously
around ``EngineCore.step()``; ``AsyncEngine`` feeds it the steps its engine
thread hands over. Either way a stop string that matches is aborted in the
core here (with FINISHED_STOPPED), through the ``CoreControl`` given: the
core itself, or the engine thread's command queue.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from engine.input_processor import InputProcessor
from engine.kv_cache.events import KVCacheEvent
from engine.lora.registry import LoRARegistry
from engine.output_processor import OutputKind, OutputProcessor, RequestOutput, TokenText
from engine.outputs import EngineCoreOutputs
from engine.request import FinishReason, Request, RequestStatus
from engine.stats import SchedulerStats
from engine.status import EngineStatus, StepTimes
from engine.worker.worker import WorkerInfo


class CoreControl(Protocol):
    """The one thing the front end asks of the core: end requests."""

    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None: ...


@dataclass
class FrontEndStep:
    """One step, processed: the outputs to hand out, then what the step's
    observers and subscribers want."""

    outputs: list[RequestOutput] = field(default_factory=list)
    scheduler_stats: list[SchedulerStats] = field(default_factory=list)
    kv_events: list[KVCacheEvent] = field(default_factory=list)


class FrontEnd:
    def __init__(
        self, core: CoreControl, tokenizer: PreTrainedTokenizerBase, info: WorkerInfo
    ) -> None:
        self.loras = LoRARegistry(info.lora, info.spec)
        self.inputs = InputProcessor(
            tokenizer,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            eos_token_id=info.eos_token_id,
            loras=self.loras,
        )
        self.status = EngineStatus()  # live: updated by every step
        self._outputs = OutputProcessor(tokenizer)
        self._step_times = StepTimes()
        self._core = core

    @property
    def token_text(self) -> TokenText:
        """One token's text (cached), as logprobs carry it."""
        return self._outputs.token_text

    def add_request(self, request: Request, prompt: str | None, kind: OutputKind) -> None:
        """Starts following ``request``'s outputs (before the core has it)."""
        self._outputs.add_request(request, prompt, kind)

    def has_unfinished(self) -> bool:
        return self._outputs.has_unfinished()

    def process_step(self, step: EngineCoreOutputs, seconds: float) -> FrontEndStep:
        """One step's core outputs (``seconds``: how long it took; 0 for an
        idle engine's stats) into request outputs and status."""
        result = FrontEndStep()
        processed = self._outputs.process(step.outputs)
        if processed.stopped_by_string:
            self._core.abort_requests(processed.stopped_by_string, RequestStatus.FINISHED_STOPPED)
        result.outputs.extend(processed.outputs)
        if step.scheduler_stats is not None:
            self.status.record(step.scheduler_stats)
            result.scheduler_stats.append(step.scheduler_stats)
        if step.kv_events:
            result.kv_events.extend(step.kv_events)
        if seconds > 0:
            self.status.num_steps += 1
            self._step_times.add(seconds, processed.num_later_tokens)
        return result

    def abort(self, request_id: str, reason: FinishReason) -> RequestOutput:
        """Ends ``request_id`` here (the caller ends it in the core) with
        ``reason``: its last output."""
        output = self._outputs.abort(request_id, reason)
        if output is None:  # not expected: the caller's requests all have a state
            output = RequestOutput(request_id, None, [], "", [], None, reason, None, 0, 0)
        return output

    def snapshot(self) -> EngineStatus:
        """A copy of the status with the recent steps' medians."""
        return dataclasses.replace(
            self.status,
            recent_step_ms_p50=self._step_times.step_ms_p50(),
            recent_token_step_ms_p50=self._step_times.token_step_ms_p50(),
        )
