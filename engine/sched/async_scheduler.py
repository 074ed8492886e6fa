"""AsyncScheduler: schedules step N+1 while step N still runs.

The engine (engine.step_pipeline) calls ``schedule()`` again before the
previous step's sampled tokens are back. Each request scheduled to sample
gets an output placeholder for that token (and one per draft it verifies):
``num_output_placeholders`` counts tokens that are computed, in
``num_computed_tokens``, but not yet in ``all_token_ids``. The base
scheduler's running loop already counts them (a request with one token in
flight is scheduled again for it, and not at all once the step in flight
reaches ``max_tokens``); here they are added after each schedule and
resolved when the real tokens arrive. With speculative decoding the drafts
for the next step are placeholders too (-1): the model runner, which
proposed them, runs its own in their place, and only those (fewer, or none,
when its proposer found fewer); it reports how many it verified, and the
rest are rewound as rejected but not counted as drafts.

Decisions equal vLLM 0.12.0's ``AsyncScheduler`` (its ``vllm/v1/core/
sched/async_scheduler.py``), with two choices of Tandem's: a request under
a grammar gets no draft placeholders (its masks for drafts need the drafts
themselves), and a request rewound by a failed KV load drops the output of
the step that was in flight for it.
"""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    def _after_schedule(self, output: SchedulerOutput) -> None:
        requests = self.requests
        drafts = output.scheduled_spec_decode_tokens
        num_spec = self.num_spec_tokens
        for req_id in output.num_scheduled_tokens:
            request = requests[req_id]
            num_drafts = len(drafts.get(req_id, ())) if drafts else 0
            placeholders = request.num_output_placeholders
            if request.num_computed_tokens != request.num_tokens + placeholders + num_drafts:
                continue  # a prompt chunk short of the end samples nothing
            # This step samples one token plus one per draft it verifies.
            request.num_output_placeholders = placeholders + 1 + num_drafts
            if num_spec and request.structured_output_request is None:
                request.spec_token_ids = [-1] * num_spec

    def update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        if request.discard_latest_async_tokens:
            request.discard_latest_async_tokens = False
            return [], False
        status_before = request.status
        new_token_ids, stopped = super().update_request_with_output(request, new_token_ids)
        request.num_output_placeholders -= len(new_token_ids)
        if request.num_output_placeholders < 0:
            raise RuntimeError(
                f"request {request.request_id}: more tokens arrived than were scheduled"
            )
        if status_before == RequestStatus.RUNNING:
            # The tokens are known now: blocks they fill can be shared.
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders
            )
        return new_token_ids, stopped

    def void_in_flight(self, request: Request) -> None:
        """``request`` was rewound (a failed KV load, a forced reset) while a
        step ran for it: that step's tokens are void."""
        if request.num_output_placeholders:
            request.num_output_placeholders = 0
            request.discard_latest_async_tokens = True
