"""Preemption: when a running request needs blocks the pool lacks, others
give theirs up (recompute-style: their KV is dropped and they go back to
the head of the queue, to be computed again when they resume).

FCFS preempts the last running request; the priority policy the worst
(priority, arrival_time). A lone request that cannot grow first asks the
``DeadlockBreaker`` for blocks parked by finished KV loads.
"""

from __future__ import annotations

from engine.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine.request import Request, RequestStatus
from engine.sched.deadlock import DeadlockBreaker
from engine.sched.request_queue import RequestQueue, SchedulingPolicy
from engine.sched.step_plan import StepPlan


class Preemptor:
    def __init__(
        self,
        policy: SchedulingPolicy,
        kv_cache_manager: KVCacheManager,
        waiting: RequestQueue,
        deadlock_breaker: DeadlockBreaker,
        num_lookahead_tokens: int,
    ) -> None:
        self.policy = policy
        self.kv_cache_manager = kv_cache_manager
        self.waiting = waiting
        self.deadlock_breaker = deadlock_breaker
        self.num_lookahead_tokens = num_lookahead_tokens
        self.num_preemptions = 0

    def make_room(
        self,
        running: list[Request],
        request: Request,
        num_new: int,
        plan: StepPlan,
        req_index: int,
    ) -> tuple[KVCacheBlocks | None, int]:
        """``request`` (at ``running[req_index]``) did not fit: preempt
        until it does. Returns (its blocks, the adjusted index), or (None,
        ...) once ``request`` itself was the one preempted."""
        while True:
            if self.victim(running) is request and len(running) == 1:
                new_blocks = self.deadlock_breaker.unblock_lone(
                    request, self.waiting, lambda: self._allocate(request, num_new)
                )
                if new_blocks is not None:
                    return new_blocks, req_index
            victim = self._pop_victim(running)
            if victim.request_id in plan.num_scheduled_tokens:
                # Already scheduled earlier in this step: undo it.
                plan.unschedule(victim)
                req_index -= 1
            self.preempt(victim)
            plan.preempted_reqs.append(victim)
            if victim is request:
                return None, req_index
            new_blocks = self._allocate(request, num_new)
            if new_blocks is not None:
                return new_blocks, req_index

    def victim(self, running: list[Request]) -> Request:
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(running, key=lambda r: (r.priority, r.arrival_time))
        return running[-1]

    def preempt(self, request: Request) -> None:
        """Drop ``request``'s KV and put it at the head of the queue. The
        caller has already taken it out of the running list."""
        if request.status != RequestStatus.RUNNING:
            raise RuntimeError(f"cannot preempt {request.request_id} in state {request.status}")
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _pop_victim(self, running: list[Request]) -> Request:
        if self.policy is SchedulingPolicy.FCFS:
            return running.pop()  # O(1) for the common policy
        victim = self.victim(running)
        running.remove(victim)
        return victim

    def _allocate(self, request: Request, num_new: int) -> KVCacheBlocks | None:
        return self.kv_cache_manager.allocate_slots(
            request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
        )
