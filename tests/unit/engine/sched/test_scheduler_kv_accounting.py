"""What the scheduler counts when KV loads fail: connector hits never go
negative nor exceed what really loaded, lost tokens are counted as
recomputed, and the connector's own failure counts reach the stats."""

from __future__ import annotations

from engine.kv_cache.stats import PrefixCacheStats
from engine.outputs import KVConnectorOutput
from engine.request import RequestStatus
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.stats import KVConnectorStats, SchedulerStats, TransferFailure
from tests.unit.engine.sched.fake_connector import FakeConnector
from tests.unit.engine.sched.harness import (
    StepResult,
    free_blocks,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)
from tests.unit.engine.sched.test_scheduler_connector import reference_tokens

PREFIX = list(range(500, 532))  # two full blocks


def _connector_stats(res: StepResult) -> PrefixCacheStats:
    assert res.stats is not None and res.stats.connector_prefix_cache_stats is not None
    return res.stats.connector_prefix_cache_stats


def _stats(sched: Scheduler) -> SchedulerStats:
    stats = sched.make_stats()
    assert stats is not None
    return stats


def _warm_prefix(sched: Scheduler) -> None:
    """A request that computes PREFIX locally: its blocks stay cached."""
    sched.add_request(make_request("r9", [*PREFIX, 7], max_tokens=1))
    run_to_completion(sched)


def test_failed_async_load_past_a_local_hit_counts_no_negative_hits() -> None:
    """P/D over NIXL: the decode pod has the shared prefix cached and reads
    the rest, which ends inside a block (51 of 52 prompt tokens). The whole
    READ fails: more tokens are cut back (to the local hit, 32) than the
    connector supplied (19)."""
    prompt = [*PREFIX, *range(900, 920)]  # 52 tokens
    conn = FakeConnector({"r0": 51}, load_async=True)
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    _warm_prefix(sched)
    sched.add_request(make_request("r0", prompt))
    r0 = sched.requests["r0"]
    step(sched)
    assert conn.allocs[-1] == ("r0", [1, 2, 4, 5], 19)
    step(
        sched,
        kv_connector_output=KVConnectorOutput(finished_recving={"r0"}, invalid_block_ids={4, 5}),
    )
    assert r0.num_computed_tokens == 32 and r0.num_external_computed_tokens == 0
    s3 = step(sched)
    assert s3.scheduled == {"r0": 20}
    assert _connector_stats(s3).hits == 0 and _connector_stats(s3).queries == 52
    assert _stats(sched).num_kv_recomputed_tokens == 19
    run_to_completion(sched)
    assert r0.output_token_ids == reference_tokens({"r0": prompt})["r0"]


def test_partly_failed_async_load_counts_what_loaded() -> None:
    """51 tokens in 4 blocks, the third bad: 32 tokens really loaded."""
    conn = FakeConnector({"r0": 51}, load_async=True)
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    sched.add_request(make_request("r0", 52))
    r0 = sched.requests["r0"]
    step(sched)
    step(
        sched, kv_connector_output=KVConnectorOutput(finished_recving={"r0"}, invalid_block_ids={3})
    )
    assert r0.num_computed_tokens == 32
    s3 = step(sched)
    assert s3.scheduled == {"r0": 20}
    assert _connector_stats(s3).hits == r0.num_external_computed_tokens == 32
    assert _stats(sched).num_kv_recomputed_tokens == 19
    run_to_completion(sched)
    assert r0.output_token_ids == reference_tokens({"r0": 52})["r0"]


def test_failed_sync_load_counts_no_hits() -> None:
    """A synchronous load fails in the step that started the request: its
    hits are counted once that step's output says what loaded."""
    conn = FakeConnector({"r0": 32})
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    sched.add_request(make_request("r0", 50))
    s1 = step(sched, kv_connector_output=KVConnectorOutput(invalid_block_ids={1}))
    assert s1.outputs == []
    assert _connector_stats(s1).hits == 0 and _connector_stats(s1).queries == 50
    assert _stats(sched).num_kv_recomputed_tokens == 32
    s2 = step(sched)
    assert s2.scheduled == {"r0": 50}
    assert _connector_stats(s2).queries == 0  # counted once
    run_to_completion(sched)
    assert sched.requests == {} and free_blocks(sched) == 99


def test_failed_sync_load_of_a_resumed_request_never_goes_negative() -> None:
    """A preempted request resumes with fewer tokens from the connector
    (16) than it had when it first started (48, its cached tokens), and that
    load fails: vLLM's arithmetic cut back 48 from the 16 supplied."""
    conn = FakeConnector({"r0": 48})
    sched = make_scheduler(
        num_blocks=6,
        max_num_batched_tokens=256,
        max_model_len=80,
        connector=conn,
        policy="priority",
        prefix_caching=False,
    )
    # Five usable blocks: r0 (4) and r1 (1) fit, until both grow.
    sched.add_request(make_request("r0", 60, max_tokens=20, priority=1))
    sched.add_request(make_request("r1", 10, max_tokens=10, priority=0))
    r0 = sched.requests["r0"]
    while r0.num_preemptions == 0:
        step(sched)
    assert r0.num_cached_tokens == 48
    conn.external["r0"] = 16
    seen = len(conn.allocs)

    def fail_its_load(so: SchedulerOutput) -> KVConnectorOutput | None:
        resumed = [a for a in conn.allocs[seen:] if a[0] == "r0"]
        return KVConnectorOutput(invalid_block_ids={resumed[0][1][0]}) if resumed else None

    res = step(sched, kv_connector_output=fail_its_load)
    while r0.status != RequestStatus.RUNNING:
        res = step(sched, kv_connector_output=fail_its_load)
    assert conn.allocs[-1][2] == 16  # the resumed load
    assert "r0" not in {o.request_id for o in res.outputs}  # its step is void
    assert r0.num_computed_tokens == 0 and r0.num_external_computed_tokens == 0
    assert _connector_stats(res).preempted_hits == 0
    assert _stats(sched).num_kv_recomputed_tokens == 16
    run_to_completion(sched)
    assert r0.output_token_ids == reference_tokens({"r0": 60}, max_tokens=20)["r0"]


def test_connector_failure_counts_and_lapsed_leases_add_up() -> None:
    sched = make_scheduler(connector=FakeConnector())
    sched.add_request(make_request("r0", 10, max_tokens=3))
    one = KVConnectorStats(leases_lapsed=1)
    one.add_failure(TransferFailure.PEER_UNREACHABLE)
    step(sched, kv_connector_output=KVConnectorOutput(stats=one))
    reported = _stats(sched).kv_connector_totals
    two = KVConnectorStats(leases_lapsed=2)
    two.add_failure(TransferFailure.PEER_UNREACHABLE)
    two.add_failure(TransferFailure.MISSING, 3)
    res = step(sched, kv_connector_output=KVConnectorOutput(stats=two))
    assert res.stats is not None
    totals = res.stats.kv_connector_totals
    assert totals.leases_lapsed == 3
    assert totals.failures == {TransferFailure.PEER_UNREACHABLE: 2, TransferFailure.MISSING: 3}
    # A snapshot once reported is never changed.
    assert reported.leases_lapsed == 1


def test_held_requests_are_counted() -> None:
    conn = FakeConnector(delay_free=True)
    sched = make_scheduler(connector=conn)
    sched.add_request(make_request("r0", 20, max_tokens=1))
    sched.add_request(make_request("r1", 20, max_tokens=3))
    s1 = step(sched)
    assert s1.stats is not None and s1.stats.num_held_requests == 1
    s2 = step(sched, kv_connector_output=KVConnectorOutput(finished_sending={"r0"}))
    assert s2.stats is not None and s2.stats.num_held_requests == 0
