"""The seeds' max_loras rule: at most max_loras distinct adapters per step;
a waiting request needing one more is skipped, not blocking those behind it."""

from __future__ import annotations

from engine.lora.request import LoRARequest
from engine.request import Request
from tests.unit.engine.sched.harness import make_request, make_scheduler, step


def _lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}", f"lora:{i:032x}")


def _request(rid: str, lora: int, prompt: int = 8) -> Request:
    request = make_request(rid, prompt, max_tokens=3)
    request.lora_request = _lora(lora) if lora else None
    return request


def _step_loras(requests: dict[str, Request], result) -> set[int]:
    return {requests[rid].lora_int_id for rid in result.scheduled} - {0}


def test_a_third_adapter_waits_without_blocking_the_queue():
    sched = make_scheduler(max_loras=2, max_num_batched_tokens=256)
    requests = {}
    for rid, lora in [("r0", 1), ("r1", 2), ("r2", 3), ("r3", 1), ("r4", 0)]:
        requests[rid] = _request(rid, lora)
        sched.add_request(requests[rid])
    first = step(sched)
    # r2 (adapter 3) is skipped; r3 (adapter 1, already in the step) and the
    # base-model r4 behind it are admitted.
    assert set(first.scheduled) == {"r0", "r1", "r3", "r4"}
    assert _step_loras(requests, first) == {1, 2}
    assert [r.request_id for r in sched.waiting] == ["r2"]
    seen = [_step_loras(requests, first)]
    while sched.has_requests():
        result = step(sched)
        seen.append(_step_loras(requests, result))
    assert all(len(s) <= 2 for s in seen)
    assert 3 in set().union(*seen)  # it ran once a slot's adapter finished


def test_without_lora_config_the_rule_is_off():
    sched = make_scheduler(max_num_batched_tokens=256)
    for rid, lora in [("r0", 1), ("r1", 2), ("r2", 3)]:
        sched.add_request(_request(rid, lora))
    assert set(step(sched).scheduled) == {"r0", "r1", "r2"}


def test_lora_requests_hash_apart_from_the_base_model():
    sched = make_scheduler(max_loras=2)
    prompt = list(range(100, 132))
    base = make_request("r0", prompt)
    adapted = make_request("r1", prompt)
    adapted.lora_request = _lora(1)
    for request in (base, adapted):
        sched.add_request(request)
    assert len(base.block_hashes) == len(adapted.block_hashes) == 2
    assert not set(base.block_hashes) & set(adapted.block_hashes)


def test_stats_count_the_requests_of_each_adapter_running_and_waiting():
    for policy in ("fcfs", "priority"):
        sched = make_scheduler(max_loras=2, max_num_batched_tokens=256, policy=policy)
        for rid, lora in [("r0", 1), ("r1", 2), ("r2", 3), ("r3", 1), ("r4", 0), ("r5", 3)]:
            sched.add_request(_request(rid, lora))
        step(sched)
        stats = sched.make_stats()
        assert stats is not None
        # Base-model requests (r4) count in neither; adapter 3 waits twice.
        assert stats.running_lora_adapters == {"a1": 2, "a2": 1}, policy
        assert stats.waiting_lora_adapters == {"a3": 2}, policy


def test_without_lora_the_stats_name_no_adapters():
    sched = make_scheduler(max_num_batched_tokens=256)
    sched.add_request(_request("r0", 1))
    step(sched)
    stats = sched.make_stats()
    assert stats is not None
    assert stats.running_lora_adapters == stats.waiting_lora_adapters == {}
