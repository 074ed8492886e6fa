"""The scheduler: vLLM v1's algorithm (seed 001), split into small parts.

There is no prefill or decode phase. Each request has ``num_computed_tokens``
that catches up with its tokens, within a per-step token budget: running
requests first (preempting when blocks run out), then waiting ones, unless
this step preempted. Chunked prefill, prefix caching, P/D
(WAITING_FOR_REMOTE_KVS) and speculative decoding all fall out of that one
mechanism. Step by step the decisions equal vLLM 0.12.0's with the same
config (pipeline parallelism and multimodal encoders aside; see
docs/scheduler.md for the departures).

This class owns the queues and the running loop; its parts:
``Preemptor`` (preemption.py) picks and preempts victims;
``WaitingAdmission`` (admission.py) admits waiting requests;
``StepUpdate`` (step_update.py) applies a step's results, with the pure
token functions of tokens.py; ``KVTransfers`` (kv_transfers.py) is the one
holder of the KV connector, ``DeadlockBreaker`` (deadlock.py) frees blocks
parked by finished loads where vLLM would stay stuck,
``SchedulerGrammars`` (grammars.py) keeps structured output's grammars
(WAITING_FOR_FSM, masks, drafts), ``AdapterBudget`` (adapter_budget.py)
keeps ``max_loras``. Output placeholders are counted by the running loop
but made only by AsyncScheduler (async_scheduler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.config import CacheConfig, ConfigError, SchedulerConfig
from engine.kv_cache.groups import blocks_held
from engine.kv_cache.hashing import BlockHasher
from engine.kv_cache.manager import KVCacheManager
from engine.outputs import (
    DraftTokenIds,
    EngineCoreOutputs,
    ModelRunnerOutput,
)
from engine.request import Request, RequestStatus
from engine.sched.adapter_budget import AdapterBudget, count_adapters
from engine.sched.admission import WaitingAdmission
from engine.sched.deadlock import DeadlockBreaker
from engine.sched.grammars import SchedulerGrammars
from engine.sched.kv_transfers import KVTransfers
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sched.partial_prefill import PartialPrefillLimiter
from engine.sched.preemption import Preemptor
from engine.sched.request_queue import SchedulingPolicy, create_request_queue
from engine.sched.step_plan import StepPlan
from engine.sched.step_update import StepUpdate
from engine.sched.stop import check_stop, remove_all
from engine.sched.tokens import append_constrained, append_tokens
from engine.stats import SchedulerStats, SpecDecodingStats

if TYPE_CHECKING:
    from engine.kv_transfer.base import KVConnectorBase
    from engine.kv_transfer.params import KVTransferParams
    from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


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
        self._check_cache_fits_one_request(num_spec_tokens)
        self.log_stats = log_stats
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            max_model_len=self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            enable_kv_events=cache_config.enable_kv_events,
            log_stats=log_stats,
            group_windows=cache_config.group_windows,
            # Rejected drafts take computed tokens back.
            max_rollback=num_spec_tokens,
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
        self.resync: set[str] = set()
        self.deadlock_breaker = DeadlockBreaker(self.kv_transfers)
        self.preemptor = Preemptor(
            self.policy,
            self.kv_cache_manager,
            self.waiting,
            self.deadlock_breaker,
            self.num_lookahead_tokens,
        )
        self.admission = WaitingAdmission(self)
        self.step_update = StepUpdate(self)
        self.grammars = SchedulerGrammars(structured_output)
        self.num_spec_tokens = num_spec_tokens
        self.spec_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        self.adapters = AdapterBudget(max_loras)

    def _check_cache_fits_one_request(self, num_spec_tokens: int) -> None:
        # A request that cannot fit even alone would block the queue forever.
        cache = self.cache_config
        groups = cache.group_windows
        chunk = self.max_num_scheduled_tokens + num_spec_tokens
        needed = sum(
            blocks_held(self.max_model_len, self.block_size, window, chunk) for window in groups
        )
        if needed > cache.num_usable_blocks:
            across = f" across its {len(groups)} KV cache groups" if len(groups) > 1 else ""
            raise ConfigError(
                f"num_blocks={cache.num_blocks} is invalid: one request of "
                f"max_model_len={self.max_model_len} tokens needs {needed} blocks of "
                f"{self.block_size}{across} plus the reserved null block"
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
            self.free_request(request)
        if held and finished_status == RequestStatus.FINISHED_ABORTED:
            # An abort that comes after the request finished here (a prefill
            # leg whose one step ended it while the abort was on its way):
            # whoever aborts never passed its kv_transfer_params on, so no
            # decode side will fetch the blocks a connector holds for it.
            self.release_held_kv(held)

    def release_held_kv(self, request_ids: Iterable[str]) -> None:
        self.kv_transfers.release_held(request_ids)

    def free_request(self, request: Request) -> KVTransferParams | None:
        """Retire a finished request; its blocks wait if a connector is
        still sending them. Returns the connector's kv_transfer_params."""
        delay_free, kv_transfer_params = self.kv_transfers.request_finished(request)
        self.finished_req_ids.add(request.request_id)
        if not delay_free:
            self.free_blocks(request)
        return kv_transfer_params

    def free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    @property
    def num_preemptions(self) -> int:
        return self.preemptor.num_preemptions

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
        plan = StepPlan(token_budget=self.max_num_scheduled_tokens)
        if self.partial_prefills is not None:
            self.partial_prefills.begin_step(self.running, self.waiting)
        self._schedule_running(plan)
        # A step that had to preempt admits nobody: blocks are short.
        if not plan.preempted_reqs:
            self.admission.schedule(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
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
                new_blocks, req_index = self.preemptor.make_room(
                    running, request, num_new, plan, req_index
                )
                if new_blocks is None:
                    break
            scheduled_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled[request.request_id] = num_new
            plan.token_budget -= num_new
            req_index += 1
            if request.spec_token_ids:
                self._schedule_spec_tokens(request, num_new, plan)

    def _schedule_spec_tokens(self, request: Request, num_new: int, plan: StepPlan) -> None:
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

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
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
            scheduled_cached_reqs=self._cached_request_data(plan),
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

    def _cached_request_data(self, plan: StepPlan) -> CachedRequestData:
        resync, self.resync = self.resync, set()
        return plan.cached_request_data(self._prev_step_scheduled, resync)

    def _after_schedule(self, output: SchedulerOutput) -> None:
        """Hook for AsyncScheduler: the step's progress has been counted."""

    def void_in_flight(self, request: Request) -> None:
        """Hook for AsyncScheduler: ``request`` was rewound for
        recomputation (a failed KV load, a forced reset)."""

    def fill_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """Asynchronous scheduling: ``output``'s masks, once the step before
        it has advanced every grammar (SchedulerGrammars.fill_pending)."""
        self.grammars.fill_pending(output, self.requests)

    # ------------------------------------------------------------------
    # update_from_output()
    # ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply a step's results: append tokens, check stops (and
        grammars), free finished requests, rewind rejected drafts."""
        return self.step_update.apply(scheduler_output, model_runner_output)

    def update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append the step's tokens; returns those kept (cut after a stop)
        and whether the request stopped."""
        step = self.grammars.advance(request, new_token_ids)
        if step is not None:
            return append_constrained(request, step, new_token_ids, self.max_model_len)
        if len(new_token_ids) == 1:  # the common case, every request every step
            request.append_output_token_id(new_token_ids[0])
            return new_token_ids, check_stop(request, self.max_model_len)
        return append_tokens(request, new_token_ids, self.max_model_len)

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        for req_id, drafts in zip(
            draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
        ):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            request.spec_token_ids = self.grammars.cut_drafts(request, drafts)

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
                self.preemptor.preempt(request)
                # A step in flight would hand back a token the recomputation
                # samples again.
                self.void_in_flight(request)
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
        if self.adapters.max_loras:  # a pass over the queues, only with LoRA on
            stats.running_lora_adapters = count_adapters(self.running)
            stats.waiting_lora_adapters = count_adapters(self.waiting.unordered())
        self.kv_transfers.report(stats)
        return stats

    def shutdown(self) -> None:
        self.kv_transfers.shutdown()
