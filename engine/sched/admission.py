"""Admission: the second half of ``schedule()``, which starts (or resumes)
waiting requests in the token budget the running ones left.

The queue's head is tried in order. A head that cannot start yet but must
not block the others is *skipped* (kept aside, put back at the head after
the step): its KV still loading (WAITING_FOR_REMOTE_KVS), its grammar still
compiling (WAITING_FOR_FSM), one LoRA adapter too many, the partial-prefill
limits, a connector that does not know its hit yet. A head that lacks
blocks stops admission, unless the ``DeadlockBreaker`` frees some.

Kept apart from the scheduler for size only: it reads and changes the
scheduler's queues and collaborators directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.kv_cache.manager import KVCacheBlocks
from engine.outputs import EngineCoreOutput
from engine.request import FinishReason, Request, RequestStatus
from engine.sched.partial_prefill import Admission
from engine.sched.request_queue import RequestQueue, create_request_queue
from engine.sched.step_plan import StepPlan
from engine.structured_output.request import GrammarState

if TYPE_CHECKING:
    from engine.sched.scheduler import Scheduler


class WaitingAdmission:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        # Requests whose grammar failed to compile, ended here: their
        # outputs go out with this step's (take_refused).
        self._refused: list[EngineCoreOutput] = []

    def take_refused(self) -> list[EngineCoreOutput]:
        refused, self._refused = self._refused, []
        return refused

    def schedule(self, plan: StepPlan) -> None:
        s = self.s
        skipped = create_request_queue(s.policy)
        waiting = s.waiting
        limiter = s.partial_prefills
        s.adapters.start_step(plan.running_reqs)
        while waiting and plan.token_budget > 0:
            if len(s.running) == s.max_num_running_reqs:
                break
            request = waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not s.kv_transfers.load_ready(request):
                    skipped.prepend_request(waiting.pop_request())
                    continue
                request.ready_to_admit()
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(
                request, skipped
            ):
                continue
            if not s.adapters.admits(request):
                skipped.prepend_request(waiting.pop_request())
                continue
            if limiter is not None:
                verdict = limiter.admit(request)
                if verdict is Admission.STOP:
                    break
                if verdict is Admission.SKIP:
                    skipped.prepend_request(waiting.pop_request())
                    continue
            if self._try_admit(request, plan, skipped):
                continue
            if not (
                plan.head_lacks_blocks
                and s.deadlock_breaker.unblock_head(request, bool(s.running), skipped, waiting)
            ):
                break
            plan.head_lacks_blocks = False  # blocks were released: try again
        if skipped:
            waiting.prepend_requests(skipped)

    def _grammar_ready(self, request: Request, skipped: RequestQueue) -> bool:
        """For the waiting head in WAITING_FOR_FSM: True once its grammar
        compiled (it is WAITING now); else it leaves the head, skipped while
        compiling, ended if the grammar failed."""
        state = self.s.grammars.activate(request)
        if state is GrammarState.READY:
            request.status = RequestStatus.WAITING
            return True
        self.s.waiting.pop_request()
        if state is GrammarState.COMPILING:
            skipped.prepend_request(request)
        else:
            self._refuse_grammar(request)
        return False

    def _refuse_grammar(self, request: Request) -> None:
        so = request.structured_output_request
        assert so is not None
        request.status = RequestStatus.FINISHED_ERROR
        self.s.free_request(request)
        error = InvalidRequestError(so.field, f"the constraint does not compile: {so.error}")
        output = EngineCoreOutput(
            request.request_id, [], FinishReason.ERROR, stop_reason=str(error), error=error
        )
        self._refused.append(output)

    def _try_admit(self, request: Request, plan: StepPlan, skipped: RequestQueue) -> bool:
        """Try to start (or resume) the request at the head of the queue.
        Returns False when nothing more can be admitted this step."""
        s = self.s
        kvm = s.kv_cache_manager
        num_external = 0
        load_async = False
        if request.num_computed_tokens == 0:
            computed_blocks, num_local = self._local_prefix(request)
            ext, load_async = s.kv_transfers.external_hit(request, num_local)
            if ext is None:
                # The connector does not know yet; ask again next step.
                skipped.prepend_request(s.waiting.pop_request())
                return True
            request.num_external_computed_tokens = num_external = ext
            num_computed = num_local + num_external
        else:
            # Back from an async KV load with some tokens already in place.
            computed_blocks, num_local = kvm.empty_kv_cache_blocks, 0
            num_computed = request.num_computed_tokens
        num_new = 0 if load_async else self._num_new_tokens(request, num_computed, plan)
        if num_new < 0:
            return False
        # No lookahead slots for a fresh request: a P/D consumer must hold
        # exactly as many blocks as the producer sends.
        lookahead = s.num_lookahead_tokens if request.num_computed_tokens else 0
        new_blocks = kvm.allocate_slots(
            request,
            num_new + num_external,
            num_local,
            computed_blocks,
            num_lookahead_tokens=lookahead,
            delay_cache_blocks=load_async,
        )
        if new_blocks is None:
            plan.head_lacks_blocks = True
            return False
        s.kv_transfers.blocks_allocated(request, computed_blocks + new_blocks, num_external)
        s.waiting.pop_request()
        if load_async:
            skipped.prepend_request(request)
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            s.kv_transfers.load_started(request.request_id, num_computed)
            return True
        self._start_running(request, num_new, num_computed, plan)
        return True

    def _local_prefix(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's prefix-cache hit (blocks, tokens). A request that
        must compute its whole prompt (prompt logprobs) reads no cache and
        asks no connector; the blocks it computes are cached all the same."""
        kvm = self.s.kv_cache_manager
        if request.skip_reading_prefix_cache:
            return kvm.empty_kv_cache_blocks, 0
        return kvm.get_computed_blocks(request)

    def _num_new_tokens(self, request: Request, num_computed: int, plan: StepPlan) -> int:
        """Tokens to compute for an admitted request, or -1 to stop admitting
        (it does not fit and chunked prefill is off)."""
        s = self.s
        num_new = request.num_tokens - num_computed
        if num_new <= 0:
            raise RuntimeError(
                f"request {request.request_id}: {num_computed} tokens already computed of "
                f"{request.num_tokens}; a connector must leave at least one to compute"
            )
        if 0 < s.long_prefill_threshold < num_new:
            num_new = s.long_prefill_threshold
        if not s.config.enable_chunked_prefill and num_new > plan.token_budget:
            return -1
        num_new = min(num_new, plan.token_budget)
        if s.partial_prefills is not None:
            num_new = min(num_new, s.partial_prefills.chunk_cap)
        return num_new

    def _start_running(
        self, request: Request, num_new: int, num_computed: int, plan: StepPlan
    ) -> None:
        s = self.s
        if s.partial_prefills is not None:
            s.partial_prefills.on_admitted(request)
        s.kv_transfers.request_started(request.request_id, num_computed)
        s.running.append(request)
        if request.status == RequestStatus.WAITING:
            plan.new_reqs.append(request)
        elif request.status == RequestStatus.PREEMPTED:
            plan.resumed_reqs.append(request)
        else:
            raise RuntimeError(f"request {request.request_id} admitted in state {request.status}")
        plan.add(request, num_new, s.kv_cache_manager.get_blocks(request.request_id))
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        s.adapters.add(request)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
