"""KVTransfers on its own: a real KVCacheManager, requests placed by hand,
the connector test double. (The scheduler's use of it is tested through the
scheduler in test_scheduler_connector.py and test_scheduler_kv_accounting.py.)"""

from __future__ import annotations

import pytest

from engine.kv_cache.hashing import BlockHasher
from engine.kv_cache.manager import KVCacheManager
from engine.kv_transfer.params import KVTransferParams
from engine.outputs import KVConnectorOutput
from engine.request import Request, RequestStatus
from engine.sched.kv_transfers import KVTransfers
from engine.stats import KVConnectorStats, SchedulerStats, TransferFailure
from tests.unit.engine.sched.fake_connector import FakeConnector
from tests.unit.engine.sched.harness import make_request

BS = 16


def make_transfers(
    connector: FakeConnector | None = None, policy: str = "recompute"
) -> tuple[KVTransfers, KVCacheManager, dict[str, Request]]:
    kvm = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=256)
    requests: dict[str, Request] = {}
    conn = FakeConnector() if connector is None else connector
    return KVTransfers(conn, kvm, requests, policy), kvm, requests


def hashed(rid: str, prompt: int) -> Request:
    request = make_request(rid, prompt)
    request.block_hasher = BlockHasher(BS)
    request.block_hashes = request.block_hasher(request)
    return request


def loading(
    transfers: KVTransfers,
    kvm: KVCacheManager,
    requests: dict[str, Request],
    rid: str,
    prompt: int,
    external: int,
) -> Request:
    """A request parked while an async load of ``external`` tokens runs
    (as the scheduler parks one)."""
    request = hashed(rid, prompt)
    requests[rid] = request
    assert kvm.allocate_slots(request, external, delay_cache_blocks=True) is not None
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    transfers.load_started(rid, external)
    return request


def running(kvm: KVCacheManager, requests: dict[str, Request], rid: str, prompt: int) -> Request:
    request = hashed(rid, prompt)
    requests[rid] = request
    assert kvm.allocate_slots(request, prompt) is not None
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = prompt
    return request


def test_an_unknown_failure_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"kv_load_failure_policy='sometimes'.*'recompute' or"):
        make_transfers(policy="sometimes")


def test_a_finished_load_sets_what_arrived_as_computed() -> None:
    transfers, kvm, requests = make_transfers()
    r0 = loading(transfers, kvm, requests, "r0", 50, 32)
    assert not transfers.load_ready(r0)  # still loading
    transfers.completions(KVConnectorOutput(finished_recving={"r0"}))
    assert transfers.load_ready(r0)
    assert r0.num_computed_tokens == 32
    assert len(kvm.block_pool.cached_blocks) == 2  # offered to the prefix cache
    assert not transfers.load_ready(r0)  # consumed


def test_a_load_of_the_whole_prompt_leaves_the_last_token_to_compute() -> None:
    transfers, kvm, requests = make_transfers()
    r0 = loading(transfers, kvm, requests, "r0", 32, 31)
    transfers.completions(KVConnectorOutput(finished_recving={"r0"}))
    assert transfers.load_ready(r0)
    assert r0.num_computed_tokens == 31


def test_a_load_counts_only_the_tokens_it_delivered() -> None:
    """A load of 37 tokens fills 3 blocks, the last one partly: the 11
    slots past them were never written, even though the request (resumed
    after a preemption, say) now has more tokens than the blocks hold."""
    transfers, kvm, requests = make_transfers()
    r0 = loading(transfers, kvm, requests, "r0", 60, 37)
    assert kvm.num_blocks("r0") == 3
    transfers.completions(KVConnectorOutput(finished_recving={"r0"}))
    assert transfers.load_ready(r0)
    assert r0.num_computed_tokens == 37
    assert len(kvm.block_pool.cached_blocks) == 2  # the partial block is not cached


def test_a_load_that_lost_every_block_gives_them_back() -> None:
    transfers, kvm, requests = make_transfers()
    r0 = loading(transfers, kvm, requests, "r0", 50, 32)
    first_block = kvm.get_block_ids("r0")[0][0]
    void = transfers.output_received(KVConnectorOutput(invalid_block_ids={first_block}), [], [r0])
    assert void == set()  # an async load has no tokens in this step
    assert r0.num_computed_tokens == 0
    transfers.completions(KVConnectorOutput(finished_recving={"r0"}))
    assert transfers.load_ready(r0)
    assert kvm.num_blocks("r0") == 0 and r0.num_computed_tokens == 0


def test_a_lost_block_in_a_sync_load_rewinds_the_running_request() -> None:
    transfers, kvm, requests = make_transfers()
    r0 = running(kvm, requests, "r0", 50)
    transfers.request_started("r0", 32)  # 32 tokens came from the connector
    r0.num_external_computed_tokens = 32
    second_block = kvm.get_block_ids("r0")[0][1]
    void = transfers.output_received(KVConnectorOutput(invalid_block_ids={second_block}), [r0], [])
    assert void == {"r0"}
    assert r0.num_computed_tokens == 16 and r0.num_external_computed_tokens == 16
    stats = SchedulerStats()
    transfers.report(stats)
    assert stats.num_kv_recomputed_tokens == 16
    assert stats.connector_prefix_cache_stats is not None
    assert stats.connector_prefix_cache_stats.hits == 16  # what really loaded


def test_fail_policy_fails_a_sync_load_at_once_and_an_async_one_when_it_ends() -> None:
    transfers, kvm, requests = make_transfers(policy="fail")
    r0 = loading(transfers, kvm, requests, "r0", 50, 32)
    bad = kvm.get_block_ids("r0")[0][0]
    transfers.output_received(KVConnectorOutput(invalid_block_ids={bad}), [], [r0])
    assert transfers.take_failed_loads(set()) == set()  # the transfer may still write
    transfers.completions(KVConnectorOutput(finished_recving={"r0"}))
    assert transfers.take_failed_loads({"r1"}) == {"r0", "r1"}
    assert transfers.take_failed_loads(set()) == set()
    stats = SchedulerStats()
    transfers.report(stats)
    assert stats.num_kv_recomputed_tokens == 0  # nothing is recomputed under "fail"


def test_recompute_policy_fails_nothing() -> None:
    transfers, _, _ = make_transfers()
    assert transfers.take_failed_loads({"r0"}) == set()


def test_completions_hand_back_sent_requests_and_count_the_unknown() -> None:
    transfers, kvm, requests = make_transfers()
    done = running(kvm, requests, "r0", 20)
    done.status = RequestStatus.FINISHED_LENGTH_CAPPED
    live = running(kvm, requests, "r1", 20)
    output = KVConnectorOutput(finished_sending={"r0", "r1"}, finished_recving={"r1", "ghost"})
    assert transfers.completions(output) == [done]
    assert not transfers.load_ready(live)  # r1 was not loading: ignored
    stats = SchedulerStats()
    transfers.report(stats)
    assert stats.num_ignored_kv_completions == 3  # r1 sent, r1 and ghost loaded


def test_request_finished_asks_the_connector_with_the_blocks() -> None:
    conn = FakeConnector(delay_free=True)
    transfers, kvm, requests = make_transfers(conn)
    r0 = running(kvm, requests, "r0", 20)
    assert transfers.request_finished(r0) == (True, KVTransferParams(remote_block_ids=(1, 2)))
    assert conn.finished == [("r0", [1, 2])]


def test_without_a_connector_nothing_is_held_or_counted() -> None:
    kvm = KVCacheManager(num_blocks=20, block_size=BS, max_model_len=256)
    transfers = KVTransfers(None, kvm, {})
    r0 = make_request("r0", 20)
    assert transfers.request_finished(r0) == (False, None)
    transfers.request_started("r0", 0)
    transfers.release_held(["r0"])
    stats = SchedulerStats()
    transfers.report(stats)
    assert stats.connector_prefix_cache_stats is None


def test_connector_totals_are_summed_into_a_new_object() -> None:
    transfers, _, _ = make_transfers()
    first = SchedulerStats()
    transfers.report(first)
    reported = first.kv_connector_totals
    failures = KVConnectorStats()
    failures.add_failure(TransferFailure.MISSING, 2)
    transfers.output_received(KVConnectorOutput(stats=failures), [], [])
    second = SchedulerStats()
    transfers.report(second)
    assert second.kv_connector_totals.failures == {TransferFailure.MISSING: 2}
    assert reported.is_empty()  # what was handed out before never changes


def test_release_one_parked_frees_the_least_urgent_finished_load() -> None:
    transfers, kvm, requests = make_transfers()
    head = loading(transfers, kvm, requests, "r0", 50, 32)
    first = loading(transfers, kvm, requests, "r1", 50, 32)
    last = loading(transfers, kvm, requests, "r2", 50, 32)
    still_loading = loading(transfers, kvm, requests, "r3", 50, 32)
    transfers.completions(KVConnectorOutput(finished_recving={"r0", "r1", "r2"}))
    queue = [head, first, last, still_loading]
    free_before = kvm.get_num_free_blocks()
    assert transfers.release_one_parked(queue, head, "a test")
    # The last in the queue whose load finished, and only it.
    assert kvm.num_blocks("r2") == 0 and last.status == RequestStatus.WAITING
    assert last.num_computed_tokens == 0
    assert kvm.get_num_free_blocks() == free_before + 2
    assert [kvm.num_blocks(r) for r in ("r0", "r1", "r3")] == [2, 2, 2]
    assert transfers.release_one_parked(queue, head, "a test")
    assert kvm.num_blocks("r1") == 0
    # The head is kept and a load still running is never touched.
    assert not transfers.release_one_parked(queue, head, "a test")


def test_pending_while_a_load_runs_or_a_connector_holds_blocks() -> None:
    transfers, kvm, requests = make_transfers()
    assert not transfers.pending()
    r0 = loading(transfers, kvm, requests, "r0", 50, 32)
    assert transfers.pending()  # its load still writes
    transfers.completions(KVConnectorOutput(finished_recving={"r0"}))
    assert not transfers.pending()  # parked, but nothing will change on its own
    r0.status = RequestStatus.FINISHED_LENGTH_CAPPED  # held for a consumer
    assert transfers.pending()
    transfers.completions(KVConnectorOutput(finished_sending={"r0"}))
    del requests["r0"]  # the scheduler frees what completions hands back
    assert not transfers.pending()
