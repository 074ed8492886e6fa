"""The scheduler: vLLM v1's algorithm (seed 001), split into small parts.

There is no prefill or decode phase. Each request has ``num_computed_tokens``
that catches up with its tokens, within a per-step token budget: running
requests first (preempting the lowest-priority one when blocks run out), then
waiting ones, unless this step preempted. Chunked prefill, prefix caching,
P/D (WAITING_FOR_REMOTE_KVS) and speculative decoding all fall out of that
one mechanism.

What a KV connector moves (loads finished or failed, blocks held while they
are sent, blocks parked by finished loads, the connector's counts) is kept
by ``KVTransfers`` (kv_transfers.py), the one holder of the connector: the
scheduler reaches the connector only through it. Whether
parked blocks must go back, where vLLM would stay stuck, is decided by
``DeadlockBreaker`` (deadlock.py).

Structured output follows the seeds too: a constrained request waits in
WAITING_FOR_FSM (skipped, not blocking the queue) until its grammar
compiled; ``SchedulerGrammars`` (grammars.py) keeps the grammars: masks,
advancing, drafts, and a grammar's end or failure.

LoRA adapters too: at most ``max_loras`` distinct adapters run in a step; a
waiting request that would add one more is skipped, not blocking the queue.

Step by step the decisions equal vLLM 0.12.0's scheduler with the same
config (pipeline parallelism and multimodal encoders aside). The running
loop counts output placeholders, which only AsyncScheduler
(async_scheduler.py) creates.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import CacheConfig, ConfigError, SchedulerConfig
from engine.errors import InvalidRequestError
from engine.kv_cache.hashing import BlockHasher
from engine.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine.outputs import (
    DraftTokenIds,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
)
from engine.request import FinishReason, Request, RequestStatus
from engine.sched.adapter_budget import AdapterBudget
from engine.sched.deadlock import DeadlockBreaker
from engine.sched.grammars import SchedulerGrammars
from engine.sched.kv_transfers import KVTransfers
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sched.partial_prefill import Admission, PartialPrefillLimiter
from engine.sched.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from engine.sched.stop import check_stop, remove_all
from engine.stats import SchedulerStats, SpecDecodingStats
from engine.structured_output.request import Advance, GrammarState

if TYPE_CHECKING:
    from connectors.base import KVConnectorBase
    from connectors.kv_transfer_params import KVTransferParams
    from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class _StepPlan:
    """The schedule under construction during one schedule() call."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    req_to_new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    resumed_reqs: list[Request] = field(default_factory=list)
    running_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The waiting head's last try found too few free blocks.
    head_lacks_blocks: bool = False


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager.

    Single-threaded: the engine core calls every method from one thread.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        connector: KVConnectorBase | None = None,
        log_stats: bool = True,
        kv_load_failure_policy: str = "recompute",
        structured_output: StructuredOutputManager | None = None,
        num_spec_tokens: int = 0,
        max_loras: int = 0,
    ) -> None:
        """`kv_load_failure_policy`: what a failed KV load does to its
        requests: "recompute" the lost tokens, or "fail" them (an error).
        `structured_output`: compiles grammars (None: constrained requests
        are refused). `num_spec_tokens`: drafts per step at most (0: no
        speculative decoding), for the acceptance stats. `max_loras`: distinct
        LoRA adapters a step may run (0: LoRA is off)."""
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.long_prefill_threshold = scheduler_config.effective_long_prefill_threshold
        self.num_lookahead_tokens = scheduler_config.num_lookahead_tokens
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self._check_cache_fits_one_request()
        self.log_stats = log_stats
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            max_model_len=self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            enable_kv_events=cache_config.enable_kv_events,
            log_stats=log_stats,
        )
        self.block_hasher = BlockHasher(cache_config.block_size)
        self.partial_prefills = (
            PartialPrefillLimiter(scheduler_config)
            if scheduler_config.partial_prefills_enabled
            else None
        )
        # Live requests, and finished ones whose blocks a connector holds.
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.kv_transfers = KVTransfers(
            connector, self.kv_cache_manager, self.requests, kv_load_failure_policy, log_stats
        )
        # Finished since the last schedule(): the runner must drop them.
        self.finished_req_ids: set[str] = set()
        # The previous step's num_scheduled_tokens (only membership is used).
        self._prev_step_scheduled: dict[str, int] = {}
        # Running requests whose last step's tokens were voided (a failed
        # KV load rewound them): the runner appended the token it sampled,
        # so the next step re-sends all their tokens.
        self._resync: set[str] = set()
        self.num_preemptions = 0
        self.deadlock_breaker = DeadlockBreaker(self.kv_transfers)
        self.grammars = SchedulerGrammars(structured_output)
        self.num_spec_tokens = num_spec_tokens
        self.spec_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        self.adapters = AdapterBudget(max_loras)
        # Requests whose grammar failed to compile, ended during schedule():
        # their outputs go out with this step's.
        self._refused: list[EngineCoreOutput] = []

    def _check_cache_fits_one_request(self) -> None:
        # A request that cannot fit even alone would block the queue forever.
        needed = -(-self.max_model_len // self.block_size)
        if needed > self.cache_config.num_usable_blocks:
            raise ConfigError(
                f"num_blocks={self.cache_config.num_blocks} is invalid: one request of "
                f"max_model_len={self.max_model_len} tokens needs {needed} blocks of "
                f"{self.block_size} plus the reserved null block"
            )

    # ------------------------------------------------------------------
    # Requests in and out
    # ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            # Also a finished request whose KV blocks are held for a remote decode.
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {request.num_prompt_tokens} tokens exceed "
                f"max_model_len={self.max_model_len}"
            )
        self.grammars.admit(request)
        # Connectors key stored KV by block hash, so they need hashes even
        # without local prefix caching (as vLLM's engine decides).
        needs_hashes = self.cache_config.enable_prefix_caching or self.kv_transfers.has_connector
        if request.block_hasher is None and needs_hashes:
            request.block_hasher = self.block_hasher
            request.block_hashes = self.block_hasher(request)
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        self.kv_transfers.request_added(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status={finished_status} is not a finished status")
        # A set, as vLLM: the order in which several requests are freed decides
        # which blocks are reused first, and this keeps it equal to vLLM's
        # under the same PYTHONHASHSEED.
        ids = (request_ids,) if isinstance(request_ids, str) else set(request_ids)
        known = [r for rid in ids if (r := self.requests.get(rid)) is not None]
        to_finish = [r for r in known if not r.is_finished()]
        held = [r.request_id for r in known if r.is_finished()]
        running = {r for r in to_finish if r.status == RequestStatus.RUNNING}
        if running:
            self.running = remove_all(self.running, running)
        waiting = [r for r in to_finish if r.status != RequestStatus.RUNNING]
        if waiting:
            self.waiting.remove_requests(waiting)
        for request in to_finish:
            request.status = finished_status
            self._free_request(request)
        if held and finished_status == RequestStatus.FINISHED_ABORTED:
            # An abort that comes after the request finished here (a prefill
            # leg whose one step ended it while the abort was on its way):
            # whoever aborts never passed its kv_transfer_params on, so no
            # decode side will fetch the blocks a connector holds for it.
            self.release_held_kv(held)

    def release_held_kv(self, request_ids: Iterable[str]) -> None:
        self.kv_transfers.release_held(request_ids)

    def _free_request(self, request: Request) -> KVTransferParams | None:
        """Retire a finished request; its blocks wait if a connector is
        still sending them. Returns the connector's kv_transfer_params."""
        delay_free, kv_transfer_params = self.kv_transfers.request_finished(request)
        self.finished_req_ids.add(request.request_id)
        if not delay_free:
            self._free_blocks(request)
        return kv_transfer_params

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        # self.requests also holds finished requests whose blocks a connector
        # still sends (delay_free): the engine keeps stepping, so the worker
        # keeps polling, until it reports them in finished_sending.
        return bool(self.requests) or self.has_finished_requests()

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    # ------------------------------------------------------------------
    # schedule()
    # ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(token_budget=self.max_num_scheduled_tokens)
        if self.partial_prefills is not None:
            self.partial_prefills.begin_step(self.running, self.waiting)
        self._schedule_running(plan)
        # A step that had to preempt admits nobody: blocks are short.
        if not plan.preempted_reqs:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        # The hot loop of the scheduler (every running request, every step):
        # attributes are bound to locals and min() is spelled out.
        running = self.running  # preemption mutates this same list
        threshold = self.long_prefill_threshold
        max_model_len = self.max_model_len
        chunk_cap = self.partial_prefills.chunk_cap if self.partial_prefills else 0
        allocate = self.kv_cache_manager.allocate_slots
        lookahead = self.num_lookahead_tokens
        scheduled_reqs = plan.running_reqs
        req_to_new_blocks = plan.req_to_new_blocks
        num_scheduled = plan.num_scheduled_tokens
        req_index = 0
        while req_index < len(running) and plan.token_budget > 0:
            request = running[req_index]
            computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            if (
                placeholders
                and computed + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens
            ):
                # Asynchronous scheduling: the step in flight reaches
                # max_tokens even if all its drafts are rejected.
                req_index += 1
                continue
            num_spec = len(request.spec_token_ids)
            num_new = len(request.all_token_ids) + num_spec + placeholders - computed
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > plan.token_budget:
                num_new = plan.token_budget
            # Drafts (and a token in flight) must leave room for the token
            # sampled after them below max_model_len. (vLLM applies the -1
            # to every request, which leaves a prompt of exactly
            # max_model_len tokens, chunked, unfinishable.)
            room = max_model_len - computed - (1 if num_spec or placeholders else 0)
            if num_new > room:
                num_new = room
            if chunk_cap and num_new > chunk_cap:
                num_new = chunk_cap
            if num_new <= 0:
                # Nothing to do this step; the requests behind it may run.
                req_index += 1
                continue
            new_blocks = allocate(request, num_new, 0, None, lookahead)
            if new_blocks is None:
                new_blocks, req_index = self._preempt_until_fits(request, num_new, plan, req_index)
                if new_blocks is None:
                    break
            scheduled_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled[request.request_id] = num_new
            plan.token_budget -= num_new
            req_index += 1
            if request.spec_token_ids:
                self._schedule_spec_tokens(request, num_new, plan)

    def _preempt_until_fits(
        self, request: Request, num_new: int, plan: _StepPlan, req_index: int
    ) -> tuple[KVCacheBlocks | None, int]:
        """``request`` did not fit: preempt lowest-priority requests until it
        does. Returns (blocks, adjusted req_index), or (None, ...) once
        ``request`` itself was the one preempted."""
        allocate = self.kv_cache_manager.allocate_slots
        while True:
            if self._preemption_victim() is request and len(self.running) == 1:
                new_blocks = self.deadlock_breaker.unblock_lone(
                    request,
                    self.waiting,
                    lambda: allocate(
                        request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
                    ),
                )
                if new_blocks is not None:
                    return new_blocks, req_index
            victim = self._pop_preemption_victim()
            if victim.request_id in plan.num_scheduled_tokens:
                # Already scheduled earlier in this step: undo it.
                self._unschedule(victim, plan)
                req_index -= 1
            self._preempt_request(victim)
            plan.preempted_reqs.append(victim)
            if victim is request:
                return None, req_index
            new_blocks = allocate(request, num_new, num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is not None:
                return new_blocks, req_index

    def _preemption_victim(self) -> Request:
        """FCFS: the last running request; priority: the worst
        (priority, arrival_time)."""
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _pop_preemption_victim(self) -> Request:
        if self.policy is SchedulingPolicy.FCFS:
            return self.running.pop()  # O(1) for the common policy
        victim = self._preemption_victim()
        self.running.remove(victim)
        return victim

    def _unschedule(self, request: Request, plan: _StepPlan) -> None:
        request_id = request.request_id
        plan.running_reqs.remove(request)
        plan.token_budget += plan.num_scheduled_tokens.pop(request_id)
        del plan.req_to_new_blocks[request_id]
        plan.spec_decode_tokens.pop(request_id, None)

    def _preempt_request(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, back to the queue head.
        The caller has already taken it out of ``running``."""
        if request.status != RequestStatus.RUNNING:
            raise RuntimeError(f"cannot preempt {request.request_id} in state {request.status}")
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _schedule_spec_tokens(self, request: Request, num_new: int, plan: _StepPlan) -> None:
        num_spec = (
            num_new
            + request.num_computed_tokens
            - request.num_tokens
            - request.num_output_placeholders
        )
        if num_spec > 0:
            del request.spec_token_ids[num_spec:]
            plan.spec_decode_tokens[request.request_id] = request.spec_token_ids
        # Fresh drafts arrive through update_draft_token_ids before next step.
        request.spec_token_ids = []

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        skipped = create_request_queue(self.policy)
        waiting = self.waiting
        limiter = self.partial_prefills
        self.adapters.start_step(plan.running_reqs)
        while waiting and plan.token_budget > 0:
            if len(self.running) == self.max_num_running_reqs:
                break
            request = waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self.kv_transfers.load_ready(request):
                    skipped.prepend_request(waiting.pop_request())
                    continue
                request.ready_to_admit()
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(
                request, skipped
            ):
                continue
            if not self.adapters.admits(request):
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
                and self.deadlock_breaker.unblock_head(
                    request, bool(self.running), skipped, waiting
                )
            ):
                break
            plan.head_lacks_blocks = False  # blocks were released: try again
        if skipped:
            waiting.prepend_requests(skipped)

    def _grammar_ready(self, request: Request, skipped: RequestQueue) -> bool:
        """For the waiting head in WAITING_FOR_FSM: True once its grammar
        compiled (it is WAITING now); else it leaves the head, skipped while
        compiling, ended if the grammar failed."""
        state = self.grammars.activate(request)
        if state is GrammarState.READY:
            request.status = RequestStatus.WAITING
            return True
        self.waiting.pop_request()
        if state is GrammarState.COMPILING:
            skipped.prepend_request(request)
        else:
            self._refuse_grammar(request)
        return False

    def _refuse_grammar(self, request: Request) -> None:
        so = request.structured_output_request
        assert so is not None
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        error = InvalidRequestError(so.field, f"the constraint does not compile: {so.error}")
        output = EngineCoreOutput(
            request.request_id, [], FinishReason.ERROR, stop_reason=str(error), error=error
        )
        self._refused.append(output)

    def _try_admit(self, request: Request, plan: _StepPlan, skipped: RequestQueue) -> bool:
        """Try to start (or resume) the request at the head of the queue.
        Returns False when nothing more can be admitted this step."""
        kvm = self.kv_cache_manager
        num_external = 0
        load_async = False
        if request.num_computed_tokens == 0:
            computed_blocks, num_local = self._local_prefix(request)
            ext, load_async = self.kv_transfers.external_hit(request, num_local)
            if ext is None:
                # The connector does not know yet; ask again next step.
                skipped.prepend_request(self.waiting.pop_request())
                return True
            request.num_external_computed_tokens = num_external = ext
            num_computed = num_local + num_external
        else:
            # Back from an async KV load with some tokens already in place.
            computed_blocks, num_local = kvm.empty_kv_cache_blocks, 0
            num_computed = request.num_computed_tokens
        num_new = 0 if load_async else self._num_new_waiting_tokens(request, num_computed, plan)
        if num_new < 0:
            return False
        # No lookahead slots for a fresh request: a P/D consumer must hold
        # exactly as many blocks as the producer sends.
        lookahead = self.num_lookahead_tokens if request.num_computed_tokens else 0
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
        self.kv_transfers.blocks_allocated(request, computed_blocks + new_blocks, num_external)
        self.waiting.pop_request()
        if load_async:
            skipped.prepend_request(request)
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.kv_transfers.load_started(request.request_id, num_computed)
            return True
        self._start_running(request, num_new, num_computed, plan)
        return True

    def _local_prefix(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's prefix-cache hit (blocks, tokens). A request that
        must compute its whole prompt (prompt logprobs) reads no cache and
        asks no connector; the blocks it computes are cached all the same."""
        kvm = self.kv_cache_manager
        if request.skip_reading_prefix_cache:
            return kvm.empty_kv_cache_blocks, 0
        return kvm.get_computed_blocks(request)

    def _num_new_waiting_tokens(self, request: Request, num_computed: int, plan: _StepPlan) -> int:
        """Tokens to compute for an admitted request, or -1 to stop admitting
        (it does not fit and chunked prefill is off)."""
        num_new = request.num_tokens - num_computed
        if num_new <= 0:
            raise RuntimeError(
                f"request {request.request_id}: {num_computed} tokens already computed of "
                f"{request.num_tokens}; a connector must leave at least one to compute"
            )
        if 0 < self.long_prefill_threshold < num_new:
            num_new = self.long_prefill_threshold
        if not self.config.enable_chunked_prefill and num_new > plan.token_budget:
            return -1
        num_new = min(num_new, plan.token_budget)
        if self.partial_prefills is not None:
            num_new = min(num_new, self.partial_prefills.chunk_cap)
        return num_new

    def _start_running(
        self, request: Request, num_new: int, num_computed: int, plan: _StepPlan
    ) -> None:
        if self.partial_prefills is not None:
            self.partial_prefills.on_admitted(request)
        self.kv_transfers.request_started(request.request_id, num_computed)
        self.running.append(request)
        if request.status == RequestStatus.WAITING:
            plan.new_reqs.append(request)
        elif request.status == RequestStatus.PREEMPTED:
            plan.resumed_reqs.append(request)
        else:
            raise RuntimeError(f"request {request.request_id} admitted in state {request.status}")
        plan.req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
            request.request_id
        )
        plan.num_scheduled_tokens[request.request_id] = num_new
        plan.token_budget -= num_new
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        self.adapters.add(request)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        num_scheduled = plan.num_scheduled_tokens
        num_common_prefix_blocks = (
            self.kv_cache_manager.get_num_common_prefix_blocks(self.running[0].request_id)
            if self.running
            else 0
        )
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(r, plan.req_to_new_blocks[r.request_id].get_block_ids())
                for r in plan.new_reqs
            ],
            scheduled_cached_reqs=self._make_cached_request_data(plan),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=plan.spec_decode_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in plan.preempted_reqs},
        )
        self._prev_step_scheduled = num_scheduled
        self.grammars.plan_masks(output, self.requests)
        output.kv_connector_metadata = self.kv_transfers.connector_metadata(output)
        # Only now advance progress: the output (and the connector) saw where
        # each request starts this step. Rejected drafts are rewound later.
        requests = self.requests
        for req_id, num_tokens in num_scheduled.items():
            requests[req_id].num_computed_tokens += num_tokens
        self._after_schedule(output)
        self.finished_req_ids = set()
        return output

    def _after_schedule(self, output: SchedulerOutput) -> None:
        """Hook for AsyncScheduler: the step's progress has been counted."""

    def _void_in_flight(self, request: Request) -> None:
        """Hook for AsyncScheduler: ``request`` was rewound for
        recomputation (a failed KV load, a forced reset)."""

    def fill_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """Asynchronous scheduling: ``output``'s masks, once the step before
        it has advanced every grammar (SchedulerGrammars.fill_pending)."""
        self.grammars.fill_pending(output, self.requests)

    def _make_cached_request_data(self, plan: _StepPlan) -> CachedRequestData:
        """Deltas for the running (then resumed) requests scheduled."""
        data = CachedRequestData()
        prev = self._prev_step_scheduled
        resync, self._resync = self._resync, set()
        new_blocks = plan.req_to_new_blocks
        req_ids = data.req_ids
        new_block_ids = data.new_block_ids
        num_computed = data.num_computed_tokens
        num_output = data.num_output_tokens
        for req in plan.running_reqs:
            req_id = req.request_id
            req_ids.append(req_id)
            if req_id not in prev or req_id in resync:
                # Skipped last step: the runner may lack its newest token;
                # rewound: the runner holds a token that was voided.
                data.all_token_ids[req_id] = req.all_token_ids.copy()
            blocks = new_blocks[req_id].blocks
            new_block_ids.append([b.block_id for b in blocks] if blocks else None)
            num_computed.append(req.num_computed_tokens)
            num_output.append(len(req.output_token_ids) + req.num_output_placeholders)
            if req.num_output_placeholders:
                data.in_flight_req_ids.add(req_id)
        for req in plan.resumed_reqs:
            req_id = req.request_id
            data.req_ids.append(req_id)
            data.resumed_req_ids.add(req_id)
            data.all_token_ids[req_id] = req.all_token_ids.copy()
            data.new_block_ids.append(new_blocks[req_id].get_block_ids(allow_none=True))
            data.num_computed_tokens.append(req.num_computed_tokens)
            data.num_output_tokens.append(len(req.output_token_ids))
        return data

    # ------------------------------------------------------------------
    # update_from_output()
    # ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply a step's results: append tokens, check stops (and
        grammars), free finished requests, rewind rejected drafts."""
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        req_id_to_index = model_runner_output.req_id_to_index
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        verified = model_runner_output.num_verified_drafts
        kv_output = model_runner_output.kv_connector_output
        outputs: list[EngineCoreOutput] = []
        # Running requests whose loaded KV was lost: rewound, tokens void.
        recovered = self.kv_transfers.output_received(kv_output, self.running, self.waiting)
        for req_id in recovered:
            self._void_in_flight(self.requests[req_id])
        self._resync |= recovered

        stopped_running: set[Request] = set()
        stopped_preempted: set[Request] = set()
        requests = self.requests
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
                    self._rewind_rejected_drafts(request, len(drafts), len(new_token_ids))
                    if self.spec_stats is not None and new_token_ids:
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
            new_token_ids, stopped = self._update_request_with_output(request, new_token_ids)
            if not new_token_ids and not stopped:
                continue  # discarded (asynchronous scheduling)
            finish_reason = kv_transfer_params = None
            if stopped:
                finish_reason = request.get_finished_reason()
                kv_transfer_params = self._free_request(request)
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
            self.running = remove_all(self.running, stopped_running)
        if stopped_preempted:
            self.waiting.remove_requests(stopped_preempted)
        if kv_output is not None:
            for request in self.kv_transfers.completions(kv_output):
                self._free_blocks(request)  # its blocks were sent
        # After the completions: the connector then knows which loads are over.
        failed = self.kv_transfers.take_failed_loads(recovered)
        if failed:
            self._end_failed_loads(failed, outputs)
        if self._refused:
            outputs.extend(self._refused)
            self._refused = []
        if outputs:
            self.deadlock_breaker.step_had_output()
        return self._package_outputs(outputs)

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append the step's tokens; returns those kept (cut after a stop)
        and whether the request stopped."""
        step = self.grammars.advance(request, new_token_ids)
        if step is not None:
            return self._update_constrained(request, step, new_token_ids)
        if len(new_token_ids) == 1:  # the common case, every request every step
            request.append_output_token_id(new_token_ids[0])
            return new_token_ids, check_stop(request, self.max_model_len)
        return self._append_tokens(request, new_token_ids, self.max_model_len)

    def _update_constrained(
        self, request: Request, step: Advance, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """As above, after the grammar saw the tokens (``step``): tokens past
        its end are dropped; a grammar that completes ends the request
        ("stop"); one that refused a token or failed ends this request
        alone, with an error."""
        kept, stopped = self._append_tokens(request, new_token_ids[: step.kept], self.max_model_len)
        if step.error is not None:
            logger.error("request %s: %s", request.request_id, step.error)
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = step.error
            return kept, True
        if step.ended and not stopped:
            request.status = RequestStatus.FINISHED_STOPPED
            return kept, True
        return kept, stopped

    def _observe_drafts(
        self, req_id: str, num_planned: int, verified: dict[str, int] | None, num_new: int
    ) -> None:
        """Stats count the drafts the runner verified: under asynchronous
        scheduling a placeholder it had no draft for is not a draft."""
        assert self.spec_stats is not None
        num_drafts = num_planned if verified is None else verified.get(req_id, num_planned)
        if num_drafts:
            self.spec_stats.observe_draft(num_drafts, num_new - 1)

    @staticmethod
    def _rewind_rejected_drafts(request: Request, num_drafts: int, num_generated: int) -> None:
        # One sampled token per accepted draft, plus one bonus token.
        num_rejected = num_drafts - (num_generated - 1)
        if request.num_computed_tokens > 0:
            request.num_computed_tokens -= num_rejected
        # Asynchronous scheduling counted the drafts as placeholders too.
        if request.num_output_placeholders > 0:
            request.num_output_placeholders -= num_rejected

    @staticmethod
    def _append_tokens(
        request: Request, new_token_ids: list[int], max_model_len: int
    ) -> tuple[list[int], bool]:
        """Append sampled tokens one by one, stopping at the first stop."""
        for num_new, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_id(token_id)
            if check_stop(request, max_model_len):
                del new_token_ids[num_new:]
                return new_token_ids, True
        return new_token_ids, False

    def _package_outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        events = self.kv_cache_manager.take_events()
        events.extend(self.kv_transfers.take_events())
        return EngineCoreOutputs(outputs, self.make_stats(), events or None)

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        for req_id, drafts in zip(
            draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
        ):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            request.spec_token_ids = self.grammars.cut_drafts(request, drafts)

    def _end_failed_loads(self, failed: set[str], outputs: list[EngineCoreOutput]) -> None:
        """Policy "fail": requests whose load lost blocks end with an error
        instead of recomputing."""
        requests = [r for rid in failed if (r := self.requests.get(rid)) is not None]
        logger.warning(
            "KV load failed for %d request(s): kv_load_failure_policy=fail ends them",
            len(requests),
        )
        self.finish_requests(failed, RequestStatus.FINISHED_ERROR)
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

    # ------------------------------------------------------------------
    # Maintenance and stats
    # ------------------------------------------------------------------

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached prefixes. Without ``reset_running_requests`` this
        only succeeds when no request holds blocks; with it, every running
        request is preempted first (and resumes by recomputation)."""
        if reset_running_requests:
            # Last first, so they return to the queue in their running order.
            while self.running:
                request = self.running.pop()
                self._preempt_request(request)
                # A step in flight would hand back a token the recomputation
                # samples again.
                self._void_in_flight(request)
            self._prev_step_scheduled = {}
        ok = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not ok:
            raise RuntimeError(
                "prefix cache not reset although every running request was preempted: "
                "requests waiting for remote KV still hold blocks"
            )
        return ok

    def make_stats(self) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        num_running, num_waiting = len(self.running), len(self.waiting)
        stats = SchedulerStats(
            num_running_reqs=num_running,
            num_waiting_reqs=num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.get_num_free_blocks(),
            num_preemptions=self.num_preemptions,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            # The rest of self.requests: finished, blocks held by a connector.
            num_held_requests=len(self.requests) - num_running - num_waiting,
            spec_decoding=self.spec_stats.copy() if self.spec_stats is not None else None,
        )
        self.kv_transfers.report(stats)
        return stats

    def shutdown(self) -> None:
        self.kv_transfers.shutdown()
