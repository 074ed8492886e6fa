"""DeadlockBreaker: when waiting requests give back the KV they park.

A request whose asynchronous KV load finished keeps ("parks") the loaded
blocks in the waiting queue until it starts. vLLM 0.12.0 can stay stuck
behind such blocks forever. Tandem steps in there, and only there, so that
wherever vLLM would go on the decisions stay vLLM's:

* deadlock: the queue's head does not fit, nothing runs (so nothing will
  finish), and no transfer is pending (no held blocks that finished_sending
  would free, no load still writing): vLLM waits forever;
* livelock: the only running request would preempt itself, nothing is
  pending, and it already did so at the same point, with no request getting
  a token since: vLLM restarts it forever. (The first time, it preempts
  itself as vLLM does: the restart may well get further.)
* a livelock of several: requests take turns running alone (one slot), each
  preempting itself at the same point as its last turn, with no request
  getting a new token in between (each turn recomputes what it had): vLLM
  cycles forever.

Then the least urgent parked request gives its blocks back (what it loaded
stays in the prefix cache), one at a time until the request in need fits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from engine.kv_cache.manager import KVCacheBlocks
from engine.request import Request
from engine.sched.kv_transfers import KVTransfers


class DeadlockBreaker:
    """Called from the scheduler thread only."""

    def __init__(self, kv_transfers: KVTransfers) -> None:
        self.kv_transfers = kv_transfers
        # Steps in which some request got tokens or finished: progress.
        self._num_output_steps = 0
        # The last request that preempted itself while running alone:
        # (request id, num_tokens, _num_output_steps, num_computed_tokens).
        self._lone_preemption: tuple[str, int, int, int] | None = None
        # Where each request last preempted itself alone since the last step
        # with a new token: request id -> num_computed_tokens.
        self._lone_points: dict[str, int] = {}

    def step_had_output(self) -> None:
        """Some request got a new token (or finished) this step: progress."""
        self._num_output_steps += 1
        self._lone_points.clear()

    def unblock_head(
        self,
        head: Request,
        anything_runs: bool,
        skipped: Iterable[Request],
        waiting: Iterable[Request],
    ) -> bool:
        """The queue's ``head`` does not fit. On a deadlock, release one
        parked request; ``skipped`` (going back to the queue's front) and
        ``waiting`` are the queue behind the head. Returns whether one was
        released (the head may then try again)."""
        if anything_runs or self.kv_transfers.pending():
            return False
        why = f"nothing runs and the queue's head {head.request_id} does not fit"
        return self.kv_transfers.release_one_parked([*skipped, *waiting], head, why)

    def unblock_lone(
        self,
        request: Request,
        waiting: Iterable[Request],
        allocate: Callable[[], KVCacheBlocks | None],
    ) -> KVCacheBlocks | None:
        """``request``, running alone, does not fit and would preempt
        itself. On a livelock, release parked requests until ``allocate``
        succeeds; returns its blocks, or None (then it preempts itself)."""
        if self.kv_transfers.pending():
            return None
        # Both checks run: each records this preemption.
        again = self._turn_again(request)
        if not self._same_point_again(request) and not again:
            return None
        why = f"{request.request_id}, running alone, would preempt itself again"
        while self.kv_transfers.release_one_parked(waiting, None, why):
            new_blocks = allocate()
            if new_blocks is not None:
                return new_blocks
        return None

    def _turn_again(self, request: Request) -> bool:
        """Whether ``request`` preempted itself alone before at this point or
        later, with no request getting a token since (several taking turns)."""
        last = self._lone_points.get(request.request_id)
        computed = request.num_computed_tokens
        if last is None or computed > last:
            self._lone_points[request.request_id] = computed
            return False
        return True

    def _same_point_again(self, request: Request) -> bool:
        """The lone request preempts itself where it did last time, no
        request having had a token since."""
        mark = (
            request.request_id,
            request.num_tokens,
            self._num_output_steps,
            request.num_computed_tokens,
        )
        last = self._lone_preemption
        if last is None or last[:3] != mark[:3] or last[3] < mark[3]:
            self._lone_preemption = mark  # a first time (or it got further)
            return False
        # Known to be stuck: until a token comes, release at once.
        self._lone_preemption = (*mark[:3], sys.maxsize)
        return True
