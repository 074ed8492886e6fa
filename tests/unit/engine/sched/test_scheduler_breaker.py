"""The deadlock breaker: waiting requests parking the blocks of finished KV
loads give them back only when nothing else could ever make room.

Each test is one of sched_traces.py's SCENARIOS; the expected
schedules up to where vLLM hangs are vLLM 0.12.0's own decisions on it
(``benchmarks/scheduler_diff.py --scenarios``). Block size 16; every load
finishes in the step after it starts.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.outputs import KVConnectorOutput
from engine.request import RequestStatus
from engine.sched.scheduler import Scheduler
from tests.unit.engine.sched.fake_connector import FakeConnector
from tests.unit.engine.sched.harness import make_request, make_scheduler, step

BREAKER = "to avoid a deadlock"


def scheduler(usable_blocks: int, connector: FakeConnector, **kw: Any) -> Scheduler:
    config: dict[str, Any] = {
        "block_size": 16,
        "num_blocks": usable_blocks + 1,
        "max_num_batched_tokens": 256,
        "max_model_len": 96,
        **kw,
    }
    return make_scheduler(connector=connector, **config)


def add(sched: Scheduler, *requests: tuple[str, int, int]) -> None:
    for rid, prompt, max_tokens in requests:
        sched.add_request(make_request(rid, prompt, max_tokens=max_tokens))


def loaded(*request_ids: str) -> KVConnectorOutput:
    return KVConnectorOutput(finished_recving=set(request_ids))


def test_a_request_finishing_in_the_same_step_makes_room(caplog: pytest.LogCaptureFixture):
    """The last running request (r1) would preempt itself while r2's
    finished load is parked, but r0 finishes in that same step: r1 is
    preempted as in vLLM and resumes from its cached prefix (1 token to
    compute) beside r2, which keeps its load."""
    sched = scheduler(7, FakeConnector({"r2": 48}, load_async=True))
    add(sched, ("r0", 30, 3), ("r1", 31, 4), ("r2", 60, 2))
    assert step(sched).scheduled == {"r0": 30, "r1": 31}
    assert step(sched, kv_connector_output=loaded("r2")).scheduled == {"r0": 1, "r1": 1}
    s2 = step(sched)
    assert (s2.scheduled, s2.sched_out.preempted_req_ids) == ({"r0": 1}, {"r1"})
    assert s2.finished() == {"r0": "length"}
    s3 = step(sched)
    assert s3.scheduled == {"r1": 1, "r2": 12}
    assert s3.sched_out.scheduled_cached_reqs.num_computed_tokens == [32]  # r1 resumed
    assert step(sched).finished() == {"r1": "length", "r2": "length"}
    assert BREAKER not in caplog.text


def test_a_delayed_free_in_the_same_step_makes_room(caplog: pytest.LogCaptureFixture):
    """Nothing runs and the head (r1, its load finished) does not fit while
    r2's finished load is parked, but r0's held blocks come back by
    finished_sending in that same step: as vLLM, wait one step and admit
    both; r2 keeps what it loaded."""
    conn = FakeConnector({"r1": 32, "r2": 32}, load_async=True, held={"r0"})
    sched = scheduler(8, conn, prefix_caching=False)
    add(sched, ("r0", 48, 1), ("r1", 56, 2), ("r2", 40, 2))
    assert step(sched).finished() == {"r0": "length"}  # its 3 blocks held
    assert step(sched, kv_connector_output=loaded("r1", "r2")).scheduled == {}
    sent = KVConnectorOutput(finished_sending={"r0"})
    assert step(sched, kv_connector_output=sent).scheduled == {}
    s3 = step(sched)
    assert s3.scheduled == {"r1": 24, "r2": 8}
    assert [r.num_computed_tokens for r in s3.sched_out.scheduled_new_reqs] == [32, 32]
    assert step(sched).finished() == {"r1": "length", "r2": "length"}
    assert BREAKER not in caplog.text


def test_a_deadlock_releases_the_least_urgent_parked_load_only(
    caplog: pytest.LogCaptureFixture,
):
    """Nothing runs, nothing is held or loading, the head (r1) does not fit:
    vLLM stays there. One parked load, the last (r3), gives its blocks back,
    and the head starts in the same step; r2 keeps its load."""
    sched = scheduler(
        7, FakeConnector({"r1": 32, "r2": 32, "r3": 32}, load_async=True), prefix_caching=False
    )
    add(sched, ("r1", 56, 2), ("r2", 40, 2), ("r3", 40, 2))
    assert step(sched).scheduled == {}
    assert step(sched, kv_connector_output=loaded("r1", "r2", "r3")).scheduled == {}
    s2 = step(sched)
    assert s2.scheduled == {"r1": 24, "r2": 8}
    assert [r.num_computed_tokens for r in s2.sched_out.scheduled_new_reqs] == [32, 32]
    assert caplog.text.count(BREAKER) == 1
    assert "waiting request r3" in caplog.text
    assert sched.requests["r3"].num_computed_tokens == 0
    finish_all(sched)


def test_a_livelock_is_broken_on_its_second_round(caplog: pytest.LogCaptureFixture):
    """r1 runs alone in 16-token chunks (no prefix caching) and hits the
    blocks r0's finished load parks. It preempts itself and starts over, as
    vLLM does (forever); the second time, r0's blocks are released."""
    sched = scheduler(
        6,
        FakeConnector({"r0": 32}, load_async=True),
        prefix_caching=False,
        max_num_batched_tokens=16,
    )
    add(sched, ("r0", 64, 2), ("r1", 80, 2))
    chunks = [{"r1": 16}] * 4
    assert [
        step(sched, kv_connector_output=loaded("r0") if i == 1 else None).scheduled
        for i in range(4)
    ] == chunks
    s4 = step(sched)
    assert (s4.scheduled, s4.sched_out.preempted_req_ids) == ({}, {"r1"})
    assert BREAKER not in caplog.text
    assert [step(sched).scheduled for _ in range(4)] == chunks  # round two, as vLLM
    s9 = step(sched)
    assert (s9.scheduled, s9.sched_out.preempted_req_ids) == ({"r1": 16}, set())
    assert caplog.text.count(BREAKER) == 1 and "waiting request r0" in caplog.text
    finish_all(sched)


def finish_all(sched: Scheduler) -> None:
    """Step until every request finished, every load completing at once."""
    for _ in range(50):
        if not sched.has_requests():
            return
        waiting = {
            r.request_id for r in sched.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        step(sched, kv_connector_output=loaded(*waiting) if waiting else None)
    raise AssertionError(f"requests left: {sched.requests}")
