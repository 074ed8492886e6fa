"""An abort that reaches the scheduler after the request finished with its
blocks held for a remote decode (delay_free) releases them."""

from __future__ import annotations

from engine.request import RequestStatus
from tests.unit.engine.sched.fake_connector import FakeConnector
from tests.unit.engine.sched.harness import free_blocks, make_request, make_scheduler, step


def test_abort_after_the_request_finished_releases_its_held_blocks() -> None:
    conn = FakeConnector(delay_free=True)
    sched = make_scheduler(connector=conn)
    sched.add_request(make_request("r0", 20, max_tokens=1))
    assert step(sched).finished() == {"r0": "length"}
    assert free_blocks(sched) == 97  # held for the consumer
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert conn.released == ["r0"]


def test_only_an_abort_after_the_finish_releases() -> None:
    """A live request's abort goes through request_finished alone (the
    connector sees its aborted status); a finish that is no abort says
    nothing about readers; an unknown id is ignored."""
    conn = FakeConnector(delay_free=True)
    sched = make_scheduler(connector=conn)
    sched.add_request(make_request("r0", 20, max_tokens=8))
    sched.add_request(make_request("r1", 20, max_tokens=1))
    assert step(sched).finished() == {"r1": "length"}
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert conn.released == [] and conn.finished[-1][0] == "r0"
    sched.finish_requests("r1", RequestStatus.FINISHED_STOPPED)
    assert conn.released == []
    sched.finish_requests(["r1", "gone"], RequestStatus.FINISHED_ABORTED)
    assert conn.released == ["r1"]
