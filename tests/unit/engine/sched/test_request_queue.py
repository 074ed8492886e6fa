"""Waiting queues keep vLLM's exact orders."""

from __future__ import annotations

from engine.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from tests.unit.engine.sched.harness import make_request


def test_fcfs_prepend_puts_requests_back_at_the_head():
    q = FCFSRequestQueue()
    a, b, c = (make_request(r, 1) for r in ("r1", "r2", "r3"))
    q.add_request(c)
    skipped = FCFSRequestQueue()
    skipped.prepend_request(a)
    skipped.prepend_request(b)
    q.prepend_requests(skipped)
    # Skipped requests return in the order they were prepended to the
    # side queue, as vLLM's scheduler leaves them.
    assert [r.request_id for r in q] == ["r2", "r1", "r3"]
    q.remove_requests([a])
    assert [r.request_id for r in q] == ["r2", "r3"]
    assert q.peek_request() is b and q.pop_request() is b


def test_priority_queue_orders_by_priority_then_arrival():
    q = create_request_queue(SchedulingPolicy.PRIORITY)
    assert isinstance(q, PriorityRequestQueue)
    reqs = [
        make_request("r1", 1, priority=1, arrival_time=0),
        make_request("r2", 1, priority=0, arrival_time=5),
        make_request("r3", 1, priority=0, arrival_time=1),
    ]
    for r in reqs:
        q.add_request(r)
    assert [r.request_id for r in q] == ["r3", "r2", "r1"]
    q.remove_request(reqs[2])
    assert q.pop_request().request_id == "r2" and len(q) == 1
