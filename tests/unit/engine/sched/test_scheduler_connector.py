"""The scheduler's KV connector paths, driven by a connector test double."""

from __future__ import annotations

import pytest

from engine.kv_transfer.params import KVTransferParams
from engine.outputs import KVConnectorOutput
from engine.request import FinishReason, RequestStatus
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from tests.unit.engine.sched.fake_connector import FakeConnector
from tests.unit.engine.sched.harness import (
    free_blocks,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def reference_tokens(
    prompts: dict[str, int | list[int]], max_tokens: int = 4
) -> dict[str, list[int]]:
    """What the requests produce with no connector at all."""
    sched = make_scheduler(max_num_batched_tokens=256)
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=max_tokens))
    tokens, _, _ = run_to_completion(sched)
    return tokens


def test_sync_external_tokens_are_not_recomputed():
    conn = FakeConnector({"r0": 32})
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    sched.add_request(make_request("r0", 50))
    s1 = step(sched)
    assert s1.scheduled == {"r0": 18}
    assert conn.allocs == [("r0", [1, 2, 3, 4], 32)]
    assert s1.sched_out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert sched.requests["r0"].num_cached_tokens == 32
    assert conn.metas == 1
    assert s1.stats is not None and s1.stats.connector_prefix_cache_stats is not None
    assert s1.stats.connector_prefix_cache_stats.hits == 32


def test_a_prompt_logprobs_request_asks_the_connector_for_nothing():
    """Loaded tokens are never computed, so their logprobs would be missing;
    the connector still sees the request's blocks (it may save them)."""
    conn = FakeConnector({"r0": 32})
    conn.unknown.add("r0")  # asking it would defer the request
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    sched.add_request(make_request("r0", 50, prompt_logprobs=1))
    s1 = step(sched)
    assert s1.scheduled == {"r0": 50}
    assert conn.allocs == [("r0", [1, 2, 3, 4], 0)]
    assert sched.requests["r0"].num_cached_tokens == 0


def test_connector_that_does_not_know_yet_defers_the_request():
    conn = FakeConnector()
    conn.unknown.add("r0")
    sched = make_scheduler(connector=conn)
    sched.add_request(make_request("r0", 10))
    sched.add_request(make_request("r1", 10))
    assert step(sched).scheduled == {"r1": 10}
    conn.unknown.clear()
    assert step(sched).scheduled == {"r0": 10, "r1": 1}


def test_async_load_parks_the_request_until_finished_recving():
    conn = FakeConnector({"r0": 32}, load_async=True)
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    sched.add_request(make_request("r0", 50))
    sched.add_request(make_request("r1", 10))
    s1 = step(sched)
    assert s1.scheduled == {"r1": 10}
    r0 = sched.requests["r0"]
    assert r0.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert conn.allocs[0] == ("r0", [1, 2], 32)
    # Blocks under load are not offered to the prefix cache yet.
    assert len(sched.kv_cache_manager.block_pool.cached_blocks) == 0
    assert step(sched).scheduled == {"r1": 1}  # load still running
    s3 = step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"r0"}))
    assert s3.scheduled == {"r1": 1}
    s4 = step(sched)
    assert s4.scheduled == {"r1": 1, "r0": 18}
    assert r0.num_cached_tokens == 32
    _tokens, _, _ = run_to_completion(sched)
    assert r0.output_token_ids == reference_tokens({"r0": 50})["r0"]


def test_async_load_of_a_whole_prompt_computes_its_last_token():
    conn = FakeConnector({"r0": 31}, load_async=True)
    sched = make_scheduler(connector=conn)
    sched.add_request(make_request("r0", 32))
    step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"r0"}))
    assert step(sched).scheduled == {"r0": 1}


def test_delayed_free_keeps_blocks_until_finished_sending():
    conn = FakeConnector(delay_free=True)
    sched = make_scheduler(connector=conn)
    sched.add_request(make_request("r0", 20, max_tokens=1))
    s1 = step(sched)
    assert s1.finished() == {"r0": "length"}
    assert s1.outputs[0].kv_transfer_params == KVTransferParams(remote_block_ids=(1, 2))
    assert conn.finished == [("r0", [1, 2])]
    assert free_blocks(sched) == 97  # held for the consumer
    assert "r0" in sched.requests and not sched.has_unfinished_requests()
    step(sched, kv_connector_output=KVConnectorOutput(finished_sending={"r0"}))
    assert free_blocks(sched) == 99
    assert "r0" not in sched.requests


def test_late_duplicate_or_unknown_completions_are_ignored(caplog):
    conn = FakeConnector(delay_free=True)
    sched = make_scheduler(connector=conn)
    sched.add_request(make_request("r0", 20, max_tokens=1))
    step(sched)
    done = KVConnectorOutput(finished_sending={"r0"}, finished_recving={"nobody"})
    step(sched, kv_connector_output=done)
    step(sched, kv_connector_output=KVConnectorOutput(finished_sending={"r0", "ghost"}))
    assert free_blocks(sched) == 99
    assert "ignoring KV send completion for unknown request" in caplog.text
    assert "ignoring KV load completion for unknown request nobody" in caplog.text
    # nobody (load), then r0 again and ghost (sends): counted for metrics.
    stats = sched.make_stats()
    assert stats is not None and stats.num_ignored_kv_completions == 3


def test_abort_while_loading_frees_the_blocks():
    conn = FakeConnector({"r0": 32}, load_async=True)
    sched = make_scheduler(connector=conn)
    sched.add_request(make_request("r0", 50))
    step(sched)
    assert free_blocks(sched) == 97
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(sched) == 99 and len(sched.waiting) == 0


def test_invalid_block_in_a_sync_load_is_recomputed():
    conn = FakeConnector({"r0": 32})
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    sched.add_request(make_request("r0", 50))
    r0 = sched.requests["r0"]
    bad_block = 2  # r0's second block, loaded from outside
    s1 = step(sched, kv_connector_output=KVConnectorOutput(invalid_block_ids={bad_block}))
    assert s1.outputs == []  # the step's token is void
    assert r0.num_computed_tokens == 16
    assert r0.num_external_computed_tokens == 16
    s2 = step(sched)
    assert s2.scheduled == {"r0": 34}
    # The runner appended the token it sampled in the void step: it gets
    # the request's tokens anew (else it would count one token more than
    # the scheduler, and never sample again).
    assert s2.sched_out.scheduled_cached_reqs.all_token_ids["r0"] == r0.all_token_ids[:50]
    run_to_completion(sched)
    assert r0.output_token_ids == reference_tokens({"r0": 50})["r0"]


def test_invalid_block_in_an_async_load_is_recomputed():
    conn = FakeConnector({"r0": 32}, load_async=True)
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    sched.add_request(make_request("r0", 50))
    r0 = sched.requests["r0"]
    step(sched)
    failed = KVConnectorOutput(finished_recving={"r0"}, invalid_block_ids={2})
    step(sched, kv_connector_output=failed)
    assert r0.num_computed_tokens == 16
    s3 = step(sched)
    assert s3.scheduled == {"r0": 34}
    # Only the valid block was offered to the prefix cache.
    assert len(sched.kv_cache_manager.block_pool.cached_blocks) == 3
    run_to_completion(sched)
    assert r0.output_token_ids == reference_tokens({"r0": 50})["r0"]


def test_async_load_that_failed_entirely_starts_over():
    conn = FakeConnector({"r0": 32}, load_async=True)
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    sched.add_request(make_request("r0", 50))
    step(sched)
    step(
        sched, kv_connector_output=KVConnectorOutput(finished_recving={"r0"}, invalid_block_ids={1})
    )
    r0 = sched.requests["r0"]
    assert r0.num_computed_tokens == 0
    conn.external.clear()  # the store lost it: the retry finds nothing
    s3 = step(sched)
    # The failed blocks were released and the prompt is computed afresh.
    assert s3.scheduled == {"r0": 50}
    assert s3.sched_out.scheduled_new_reqs[0].block_ids == ([3, 4, 5, 6],)
    assert free_blocks(sched) == 99 - 4


def test_invalid_block_shared_by_two_requests_is_recomputed_once():
    shared = list(range(700, 748))
    conn = FakeConnector({"r0": 32})
    sched = make_scheduler(max_num_batched_tokens=256, connector=conn)
    sched.add_request(make_request("r0", [*shared, 1, 2]))
    sched.add_request(make_request("r1", [*shared, 5, 6, 7, 8]))
    r0, r1 = sched.requests["r0"], sched.requests["r1"]
    s1 = step(sched, kv_connector_output=KVConnectorOutput(invalid_block_ids={1}))
    # r1 hit r0's (externally loaded) blocks locally.
    assert s1.scheduled == {"r0": 18, "r1": 4}
    assert s1.outputs == []
    assert r0.num_computed_tokens == 0  # recomputes the bad block
    assert r1.num_computed_tokens == r1.num_cached_tokens == 48  # waits for r0's redo
    s2 = step(sched)
    assert s2.scheduled == {"r0": 50, "r1": 4}
    run_to_completion(sched)
    ref = reference_tokens({"r0": [*shared, 1, 2], "r1": [*shared, 5, 6, 7, 8]})
    assert r0.output_token_ids == ref["r0"]
    assert r1.output_token_ids == ref["r1"]


@pytest.mark.parametrize("load_async", [False, True])
def test_invalid_blocks_never_lose_a_request(load_async):
    conn = FakeConnector({f"r{i}": 32 for i in range(6)}, load_async=load_async)
    sched = make_scheduler(max_num_batched_tokens=64, connector=conn)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 40 + i, max_tokens=3))
    every_block = set(range(1, 100))
    step(sched)
    recv = KVConnectorOutput(
        finished_recving={r.request_id for r in sched.waiting} if load_async else None,
        invalid_block_ids=every_block,
    )
    step(sched, kv_connector_output=recv)
    conn.external.clear()  # whatever is asked again is not there any more
    _tokens, reasons, _ = run_to_completion(sched)
    assert reasons == {f"r{i}": "length" for i in range(6)}
    assert free_blocks(sched) == 99


def test_requests_are_hashed_for_a_connector_even_without_prefix_caching():
    sched = make_scheduler(prefix_caching=False, connector=FakeConnector())
    sched.add_request(make_request("r0", 40))
    assert len(sched.requests["r0"].block_hashes) == 2
    plain = make_scheduler(prefix_caching=False)
    plain.add_request(make_request("r0", 40))
    assert plain.requests["r0"].block_hashes == []


def _policy_fail_scheduler(conn: FakeConnector) -> Scheduler:
    return make_scheduler(max_num_batched_tokens=256, connector=conn, kv_load_failure_policy="fail")


def test_fail_policy_ends_a_request_whose_sync_load_failed():
    conn = FakeConnector({"r0": 32})
    sched = _policy_fail_scheduler(conn)
    sched.add_request(make_request("r0", 50))
    s1 = step(sched, kv_connector_output=KVConnectorOutput(invalid_block_ids={2}))
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in s1.outputs] == [
        ("r0", FinishReason.ERROR, [])
    ]
    assert s1.outputs[0].stop_reason == "KV load failed (kv_load_failure_policy=fail)"
    assert "r0" not in sched.requests and free_blocks(sched) == 99
    assert not sched.has_unfinished_requests()


def test_fail_policy_waits_for_an_async_load_to_finish_before_failing_it():
    """Blocks of a load still in flight must not be freed (the transfer would
    write into reused blocks): the request fails when its load completes."""
    conn = FakeConnector({"r0": 32}, load_async=True)
    sched = _policy_fail_scheduler(conn)
    sched.add_request(make_request("r0", 50))
    step(sched)
    s2 = step(sched, kv_connector_output=KVConnectorOutput(invalid_block_ids={2}))
    assert s2.outputs == [] and "r0" in sched.requests
    assert sched.requests["r0"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s3 = step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"r0"}))
    assert [(o.request_id, o.finish_reason) for o in s3.outputs] == [("r0", FinishReason.ERROR)]
    assert free_blocks(sched) == 99 and not sched.has_unfinished_requests()


def test_fail_policy_with_completion_and_error_in_one_step():
    conn = FakeConnector({"r0": 32, "r1": 0}, load_async=True)
    sched = _policy_fail_scheduler(conn)
    sched.add_request(make_request("r0", 50))
    sched.add_request(make_request("r1", 20))
    step(sched)
    failed = KVConnectorOutput(finished_recving={"r0"}, invalid_block_ids={1})
    s2 = step(sched, kv_connector_output=failed)
    assert [(o.request_id, o.finish_reason) for o in s2.outputs if o.finished] == [
        ("r0", FinishReason.ERROR)
    ]
    run_to_completion(sched)  # the other request is unharmed
    assert sched.requests == {} or all(r.is_finished() for r in sched.requests.values())
    assert free_blocks(sched) == 99


def test_unknown_failure_policy_is_refused():
    with pytest.raises(ValueError, match="kv_load_failure_policy='sometimes'"):
        make_scheduler(kv_load_failure_policy="sometimes")


def test_a_preempted_request_back_from_an_async_load_resumes_with_all_its_tokens():
    """A preempted request whose prompt a store connector loads again: once
    the load is in, it resumes (the runner gets all its tokens), never
    starts as a new request (which the runner would know only by its
    prompt, computing its outputs' KV from the wrong tokens)."""
    conn = FakeConnector(load_async=True)
    sched = make_scheduler(
        num_blocks=8,
        max_model_len=112,
        max_num_batched_tokens=128,
        prefix_caching=False,
        connector=conn,
    )
    sched.add_request(make_request("r0", 48, max_tokens=20))
    sched.add_request(make_request("r1", 48, max_tokens=20))
    step(sched)
    assert step(sched).sched_out.preempted_req_ids == {"r1"}
    r1 = sched.requests["r1"]
    conn.external["r1"] = 32  # the store holds its first two blocks

    def loads_at_once(so: SchedulerOutput) -> KVConnectorOutput | None:
        parked = r1.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        return KVConnectorOutput(finished_recving={"r1"}) if parked else None

    resumed = None
    while sched.has_unfinished_requests():
        result = step(sched, kv_connector_output=loads_at_once)
        assert "r1" not in {n.req_id for n in result.sched_out.scheduled_new_reqs}
        if "r1" in result.sched_out.scheduled_cached_reqs.resumed_req_ids:
            resumed = result
    assert resumed is not None and r1.num_preemptions == 1
    cached = resumed.sched_out.scheduled_cached_reqs
    assert cached.all_token_ids["r1"] == r1.all_token_ids[: len(cached.all_token_ids["r1"])]
    assert resumed.scheduled["r1"] == 49 - 32  # the loaded 32 are not recomputed
    assert r1.output_token_ids == [1001 + 7 * i for i in range(20)]
