"""The v0 knobs: at most N prefills in flight, at most M of them long."""

from __future__ import annotations

from engine.sched.scheduler import Scheduler
from tests.unit.engine.sched.harness import make_request, make_scheduler, run_to_completion, step


def add_mix(sched: Scheduler) -> None:
    for rid, n in (("r1", 200), ("r2", 200), ("r3", 20), ("r4", 20)):
        sched.add_request(make_request(rid, n, max_tokens=3))


def test_off_by_default_every_prompt_shares_the_budget():
    sched = make_scheduler(
        max_num_batched_tokens=128,
        max_model_len=1000,
        num_blocks=200,
        long_prefill_token_threshold=40,
    )
    add_mix(sched)
    assert step(sched).scheduled == {"r1": 40, "r2": 40, "r3": 20, "r4": 20}


def test_short_prompts_jump_a_long_one_when_the_long_limit_is_reached():
    sched = make_scheduler(
        max_num_batched_tokens=128,
        max_model_len=1000,
        num_blocks=200,
        long_prefill_token_threshold=40,
        max_num_partial_prefills=2,
        max_long_partial_prefills=1,
    )
    add_mix(sched)
    # r2 (long) is skipped while r1 is a long prefill in flight; r3 takes
    # the second prefill slot; r4 must wait (two prefills in flight).
    assert step(sched).scheduled == {"r1": 40, "r3": 20}
    assert [r.request_id for r in sched.waiting] == ["r2", "r4"]
    assert step(sched).scheduled == {"r1": 40, "r3": 1, "r4": 20}
    _tokens, reasons, _ = run_to_completion(sched)
    assert set(reasons) == {"r1", "r2", "r3", "r4"}


def test_chunks_are_capped_at_an_even_share_of_the_budget():
    sched = make_scheduler(
        max_num_batched_tokens=100,
        max_model_len=1000,
        num_blocks=200,
        long_prefill_token_threshold=500,
        max_num_partial_prefills=2,
        max_long_partial_prefills=2,
    )
    sched.add_request(make_request("r1", 300, max_tokens=2))
    sched.add_request(make_request("r2", 300, max_tokens=2))
    assert step(sched).scheduled == {"r1": 50, "r2": 50}


def test_default_long_threshold_is_four_percent_of_max_model_len():
    sched = make_scheduler(
        max_num_batched_tokens=512,
        max_model_len=1000,
        num_blocks=200,
        max_num_partial_prefills=4,
        max_long_partial_prefills=1,
    )
    sched.add_request(make_request("r1", 100, max_tokens=2))
    sched.add_request(make_request("r2", 100, max_tokens=2))
    sched.add_request(make_request("r3", 30, max_tokens=2))
    assert step(sched).scheduled == {"r1": 40, "r3": 30}
