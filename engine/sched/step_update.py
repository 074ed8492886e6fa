"""StepUpdate: ``Scheduler.update_from_output``, which applies one step's
results to the requests it ran.

Per scheduled request: drafts the sampler rejected are rewound, sampled
tokens appended up to a stop or the grammar's end (the scheduler's
``update_request_with_output``, which AsyncScheduler extends), finished
requests freed (or held while a connector sends their blocks). Around
that: running requests whose loaded KV was lost are rewound first, blocks
a connector finished sending are freed, and under policy "fail" requests
whose load failed end with an error.

Kept apart from the scheduler for size only: it reads and changes the
scheduler's queues and collaborators directly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput
from engine.request import FinishReason, Request, RequestStatus
from engine.sched.output import SchedulerOutput
from engine.sched.stop import remove_all
from engine.sched.tokens import rewind_rejected_drafts

if TYPE_CHECKING:
    from engine.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


class StepUpdate:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def apply(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply a step's results: append tokens, check stops (and
        grammars), free finished requests, rewind rejected drafts."""
        s = self.s
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        req_id_to_index = model_runner_output.req_id_to_index
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        verified = model_runner_output.num_verified_drafts
        kv_output = model_runner_output.kv_connector_output
        outputs: list[EngineCoreOutput] = []
        # Running requests whose loaded KV was lost: rewound, tokens void.
        recovered = s.kv_transfers.output_received(kv_output, s.running, s.waiting)
        for req_id in recovered:
            s.void_in_flight(s.requests[req_id])
        s.resync |= recovered

        stopped_running: set[Request] = set()
        stopped_preempted: set[Request] = set()
        requests = s.requests
        preempted = RequestStatus.PREEMPTED
        # The other hot loop: one pass per scheduled request per step.
        for req_id in scheduler_output.num_scheduled_tokens:
            if req_id in recovered:
                continue  # rewound for recomputation; its tokens are void
            request = requests.get(req_id)
            if request is None or request.status > preempted:
                continue  # finished (aborted) while the step ran
            req_index = req_id_to_index[req_id]
            new_token_ids = sampled_token_ids[req_index] if sampled_token_ids else []
            if spec_tokens:
                drafts = spec_tokens.get(req_id)
                if drafts and not request.discard_latest_async_tokens:
                    rewind_rejected_drafts(request, len(drafts), len(new_token_ids))
                    if s.spec_stats is not None and new_token_ids:
                        self._observe_drafts(req_id, len(drafts), verified, len(new_token_ids))
            if not new_token_ids:
                # Mid-prefill: nothing to report but prompt logprobs.
                if prompt_logprobs and req_id in prompt_logprobs:
                    outputs.append(
                        EngineCoreOutput(
                            req_id,
                            [],
                            num_cached_tokens=request.num_cached_tokens,
                            new_prompt_logprobs=prompt_logprobs[req_id],
                        )
                    )
                continue
            status_before = request.status
            new_token_ids, stopped = s.update_request_with_output(request, new_token_ids)
            if not new_token_ids and not stopped:
                continue  # discarded (asynchronous scheduling)
            finish_reason = kv_transfer_params = None
            if stopped:
                finish_reason = request.get_finished_reason()
                kv_transfer_params = s.free_request(request)
                if status_before == RequestStatus.RUNNING:
                    stopped_running.add(request)
                else:
                    stopped_preempted.add(request)
            new_logprobs = (
                logprobs.slice_request(req_index, len(new_token_ids))
                if logprobs is not None and request.sampling_params.logprobs is not None
                else None
            )
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    finish_reason,
                    new_logprobs,
                    request.stop_reason,
                    kv_transfer_params,
                    request.num_cached_tokens,
                    prompt_logprobs.get(req_id) if prompt_logprobs else None,
                )
            )
        if stopped_running:
            s.running = remove_all(s.running, stopped_running)
        if stopped_preempted:
            s.waiting.remove_requests(stopped_preempted)
        if kv_output is not None:
            for request in s.kv_transfers.completions(kv_output):
                s.free_blocks(request)  # its blocks were sent
        # After the completions: the connector then knows which loads are over.
        failed = s.kv_transfers.take_failed_loads(recovered)
        if failed:
            self._end_failed_loads(failed, outputs)
        outputs.extend(s.admission.take_refused())
        if any(o.new_token_ids or o.finish_reason is not None for o in outputs):
            s.deadlock_breaker.step_had_output()
        return self._package_outputs(outputs)

    def _observe_drafts(
        self, req_id: str, num_planned: int, verified: dict[str, int] | None, num_new: int
    ) -> None:
        """Stats count the drafts the runner verified: under asynchronous
        scheduling a placeholder it had no draft for is not a draft."""
        s = self.s
        assert s.spec_stats is not None
        num_drafts = num_planned if verified is None else verified.get(req_id, num_planned)
        if num_drafts:
            s.spec_stats.observe_draft(num_drafts, num_new - 1)

    def _package_outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        s = self.s
        events = s.kv_cache_manager.take_events()
        events.extend(s.kv_transfers.take_events())
        return EngineCoreOutputs(outputs, s.make_stats(), events or None)

    def _end_failed_loads(self, failed: set[str], outputs: list[EngineCoreOutput]) -> None:
        """Policy "fail": requests whose load lost blocks end with an error
        instead of recomputing."""
        s = self.s
        requests = [r for rid in failed if (r := s.requests.get(rid)) is not None]
        logger.warning(
            "KV load failed for %d request(s): kv_load_failure_policy=fail ends them",
            len(requests),
        )
        s.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        for request in requests:
            outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    [],
                    FinishReason.ERROR,
                    stop_reason="KV load failed (kv_load_failure_policy=fail)",
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
