"""FrontEnd: outputs, stop strings and status around a core, with the real tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from transformers import PreTrainedTokenizerBase

from engine.frontend import FrontEnd
from engine.kv_cache.events import AllBlocksCleared, KVCacheEvent
from engine.kv_cache.stats import PrefixCacheStats
from engine.models.loader import load_tokenizer, resolve_model
from engine.output_processor import OutputKind
from engine.outputs import EngineCoreOutput, EngineCoreOutputs
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.stats import SchedulerStats
from engine.worker.worker import WorkerInfo


@dataclass
class AbortRecorder:
    """A CoreControl that records what the front end ends in the core."""

    aborted: list[tuple[list[str], RequestStatus]] = field(default_factory=list)

    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.aborted.append((list(request_ids), status))


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(resolve_model(None))


def _front(tokenizer: PreTrainedTokenizerBase) -> tuple[FrontEnd, AbortRecorder]:
    core = AbortRecorder()
    info = WorkerInfo(resolve_model(None), "m", "LlamaForCausalLM", 49152, 64, 8, 2)
    return FrontEnd(core, tokenizer, info), core


def _add(front: FrontEnd, rid: str, kind: OutputKind, **params: object) -> Request:
    inputs = front.inputs
    request = inputs.make_request(rid, inputs.process_prompt([1, 2, 3]), SamplingParams(**params))  # type: ignore[arg-type]
    front.add_request(request, None, kind)
    return request


def _step(*outputs: EngineCoreOutput, stats: SchedulerStats | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(list(outputs), scheduler_stats=stats)


def test_a_stop_string_ends_the_request_in_the_core(tokenizer: PreTrainedTokenizerBase) -> None:
    front, core = _front(tokenizer)
    _add(front, "r", OutputKind.DELTA, stop=["four"], max_tokens=10)
    ids = tokenizer.encode(" one two three four five")
    outputs = front.process_step(_step(EngineCoreOutput("r", ids)), 0.01).outputs
    assert core.aborted == [(["r"], RequestStatus.FINISHED_STOPPED)]
    (out,) = outputs
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == "four"
    assert out.text == " one two three " and out.finished
    assert not front.has_unfinished()


def test_delta_outputs_stream_each_step_and_final_ones_come_once(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    front, _ = _front(tokenizer)
    _add(front, "streamed", OutputKind.DELTA, max_tokens=2)
    _add(front, "offline", OutputKind.FINAL, max_tokens=2)
    hello, world = tokenizer.encode("Hello world")
    first = front.process_step(
        _step(EngineCoreOutput("streamed", [hello]), EngineCoreOutput("offline", [hello])), 0.01
    ).outputs
    assert [(o.request_id, o.text, o.token_ids) for o in first] == [("streamed", "Hello", [hello])]
    last = front.process_step(
        _step(
            EngineCoreOutput("streamed", [world], FinishReason.LENGTH),
            EngineCoreOutput("offline", [world], FinishReason.LENGTH),
        ),
        0.01,
    ).outputs
    streamed, offline = last
    assert (streamed.text, streamed.token_ids, streamed.num_generated_tokens) == (
        " world",
        [world],
        2,
    )
    assert (offline.text, offline.token_ids) == ("Hello world", [hello, world])
    assert offline.finish_reason is FinishReason.LENGTH and offline.num_prompt_tokens == 3


def test_status_sums_the_steps_and_counts_real_ones(tokenizer: PreTrainedTokenizerBase) -> None:
    front, _ = _front(tokenizer)
    stats = SchedulerStats(
        num_running_reqs=1,
        num_preemptions=2,
        prefix_cache_stats=PrefixCacheStats(queries=10, hits=4),
    )
    events: list[KVCacheEvent] = [AllBlocksCleared()]
    step = front.process_step(EngineCoreOutputs([], stats, events), 0.02)
    assert step.scheduler_stats == [stats] and step.kv_events == events
    front.process_step(_step(stats=stats), 0.0)  # an idle engine's stats: not a step
    status = front.snapshot()
    assert (status.prefix_cache_queries, status.prefix_cache_hits) == (20, 8)
    assert status.num_preemptions == 2 and status.num_running == 1
    assert status.num_steps == 1
    assert status.recent_step_ms_p50 == pytest.approx(20.0)


def test_only_tokens_after_a_first_one_are_inter_token_gaps(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    front, _ = _front(tokenizer)
    _add(front, "a", OutputKind.DELTA, max_tokens=5)
    front.process_step(_step(EngineCoreOutput("a", [5])), 0.01)  # the first token
    assert front.snapshot().recent_token_step_ms_p50 == 0.0
    front.process_step(_step(EngineCoreOutput("a", [6, 7])), 0.03)
    assert front.snapshot().recent_token_step_ms_p50 == pytest.approx(30.0)


def test_abort_ends_a_request_with_its_reason(tokenizer: PreTrainedTokenizerBase) -> None:
    front, core = _front(tokenizer)
    _add(front, "a", OutputKind.DELTA)
    front.process_step(_step(EngineCoreOutput("a", [5, 6])), 0.01)
    out = front.abort("a", FinishReason.ABORT)
    assert out.finish_reason is FinishReason.ABORT and out.token_ids == [] and out.text == ""
    assert out.num_generated_tokens == 2
    assert not front.has_unfinished() and not core.aborted  # the caller ends it in the core
    # Outputs the core still had for it are dropped.
    assert front.process_step(_step(EngineCoreOutput("a", [7])), 0.01).outputs == []
    unknown = front.abort("never-added", FinishReason.ERROR)
    assert unknown.finished and unknown.request_id == "never-added"
