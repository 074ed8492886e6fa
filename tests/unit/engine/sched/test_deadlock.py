"""DeadlockBreaker on its own: when it releases parked blocks and when it
leaves the scheduler to do what vLLM does. (Whole traces of both cases, as
vLLM decides them, are in test_scheduler_breaker.py.)"""

from __future__ import annotations

from engine.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine.outputs import KVConnectorOutput
from engine.request import Request, RequestStatus
from engine.sched.deadlock import DeadlockBreaker
from engine.sched.kv_transfers import KVTransfers
from tests.unit.engine.sched.test_kv_transfers import loading, make_transfers, running


def parked_setup() -> tuple[DeadlockBreaker, KVTransfers, KVCacheManager, list[Request]]:
    """r0 and r1 park the blocks of finished loads; r2 is the request in need."""
    transfers, kvm, requests = make_transfers()
    parked = [loading(transfers, kvm, requests, rid, 50, 32) for rid in ("r0", "r1")]
    transfers.completions(KVConnectorOutput(finished_recving={"r0", "r1"}))
    return DeadlockBreaker(transfers), transfers, kvm, parked


def test_a_head_that_does_not_fit_waits_while_something_runs() -> None:
    breaker, _, kvm, parked = parked_setup()
    head = parked[0]
    assert not breaker.unblock_head(head, True, [], parked)
    assert kvm.num_blocks("r1") == 2


def test_a_head_that_does_not_fit_waits_for_a_pending_transfer() -> None:
    breaker, transfers, kvm, parked = parked_setup()
    loading(transfers, kvm, transfers.requests, "r9", 50, 16)  # still writing
    assert not breaker.unblock_head(parked[0], False, [], parked)
    assert kvm.num_blocks("r1") == 2


def test_a_deadlocked_head_gets_one_parked_request_released() -> None:
    breaker, _, kvm, parked = parked_setup()
    head = running(kvm, breaker.kv_transfers.requests, "r2", 20)
    head.status = RequestStatus.WAITING
    assert breaker.unblock_head(head, False, [parked[0]], [parked[1]])
    assert (kvm.num_blocks("r0"), kvm.num_blocks("r1")) == (2, 0)  # the last one


def lone(kvm: KVCacheManager, requests: dict[str, Request]) -> Request:
    request = running(kvm, requests, "r2", 20)
    request.num_computed_tokens = 16
    return request


def test_a_lone_request_preempts_itself_first_and_is_unblocked_the_second_time() -> None:
    breaker, _, kvm, parked = parked_setup()
    request = lone(kvm, breaker.kv_transfers.requests)
    allocated: list[KVCacheBlocks] = []

    def allocate() -> KVCacheBlocks | None:
        allocated.append(KVCacheBlocks(()))
        return allocated[-1]

    assert breaker.unblock_lone(request, parked, allocate) is None  # as vLLM: preempt
    assert kvm.num_blocks("r1") == 2
    assert breaker.unblock_lone(request, parked, allocate) is allocated[0]
    assert (kvm.num_blocks("r0"), kvm.num_blocks("r1")) == (2, 0)


def test_progress_since_the_last_time_means_no_livelock() -> None:
    breaker, _, kvm, parked = parked_setup()
    request = lone(kvm, breaker.kv_transfers.requests)

    def allocate() -> KVCacheBlocks | None:
        return KVCacheBlocks(())

    assert breaker.unblock_lone(request, parked, allocate) is None
    breaker.step_had_output()  # some request got a token
    assert breaker.unblock_lone(request, parked, allocate) is None
    request.num_computed_tokens += 16  # it got further this time
    assert breaker.unblock_lone(request, parked, allocate) is None
    assert kvm.num_blocks("r0") == kvm.num_blocks("r1") == 2


def test_a_lone_request_releases_until_it_fits() -> None:
    breaker, _, kvm, parked = parked_setup()
    request = lone(kvm, breaker.kv_transfers.requests)
    free_needed = kvm.get_num_free_blocks() + 4  # both parked loads' blocks

    def allocate() -> KVCacheBlocks | None:
        return KVCacheBlocks(()) if kvm.get_num_free_blocks() >= free_needed else None

    breaker.unblock_lone(request, parked, allocate)
    assert breaker.unblock_lone(request, parked, allocate) is not None
    assert kvm.num_blocks("r0") == kvm.num_blocks("r1") == 0


def test_requests_taking_turns_to_preempt_themselves_are_a_livelock() -> None:
    """Two requests share one slot and each preempts itself at the same
    point as on its last turn, no token kept in between (found by
    test_scheduler_properties: a 1-slot, 7-block trace with parked loads
    cycled forever): the second round releases parked blocks."""
    breaker, _, kvm, parked = parked_setup()
    first = lone(kvm, breaker.kv_transfers.requests)
    second = running(kvm, breaker.kv_transfers.requests, "r3", 12)
    second.num_computed_tokens = 8

    def allocate() -> KVCacheBlocks | None:
        return KVCacheBlocks(())

    assert breaker.unblock_lone(first, parked, allocate) is None  # as vLLM
    assert breaker.unblock_lone(second, parked, allocate) is None  # as vLLM
    assert kvm.num_blocks("r1") == 2
    assert breaker.unblock_lone(first, parked, allocate) is not None  # the same again
    assert kvm.num_blocks("r1") == 0


def test_a_token_between_turns_is_progress() -> None:
    breaker, _, kvm, parked = parked_setup()
    first = lone(kvm, breaker.kv_transfers.requests)
    second = running(kvm, breaker.kv_transfers.requests, "r3", 12)

    def allocate() -> KVCacheBlocks | None:
        return KVCacheBlocks(())

    assert breaker.unblock_lone(first, parked, allocate) is None
    assert breaker.unblock_lone(second, parked, allocate) is None
    breaker.step_had_output()  # a token kept: the turns got somewhere
    assert breaker.unblock_lone(first, parked, allocate) is None
    assert kvm.num_blocks("r1") == 2
