"""Scripted schedule()/update_from_output() sequences for each seed path."""

from __future__ import annotations

import pytest

from engine.config import ConfigError
from engine.outputs import DraftTokenIds
from engine.request import RequestStatus
from tests.unit.engine.sched.harness import (
    EOS,
    default_token,
    free_blocks,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def test_chunked_prefill_spans_steps_then_decodes():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request("r0", 150, max_tokens=2))
    s1 = step(sched)
    assert s1.scheduled == {"r0": 64}
    assert s1.sched_out.scheduled_new_reqs[0].block_ids == ([1, 2, 3, 4],)
    assert s1.outputs == []  # mid-prefill: nothing sampled
    s2 = step(sched)
    assert s2.scheduled == {"r0": 64}
    assert s2.sched_out.scheduled_cached_reqs.new_block_ids == [([5, 6, 7, 8],)]
    s3 = step(sched)
    assert s3.scheduled == {"r0": 22}
    assert s3.sched_out.scheduled_cached_reqs.new_block_ids == [([9, 10],)]
    assert s3.tokens("r0") == [default_token(sched.requests["r0"]) - 7]
    assert free_blocks(sched) == 99 - 10
    s4 = step(sched)
    assert s4.scheduled == {"r0": 1}
    assert s4.finished() == {"r0": "length"}
    assert free_blocks(sched) == 99
    assert "r0" not in sched.requests
    # The runner hears about the finish in the next step's output.
    assert sched.schedule().finished_req_ids == {"r0"}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=64, chunked_prefill=False)
    sched.add_request(make_request("r0", 40))
    sched.add_request(make_request("r1", 30))
    assert step(sched).scheduled == {"r0": 40}
    assert step(sched).scheduled == {"r0": 1, "r1": 30}


def test_chunked_prefill_off_needs_budget_for_max_model_len():
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=64, max_model_len=128, chunked_prefill=False)


def test_long_prefill_threshold_caps_each_chunk():
    sched = make_scheduler(max_num_batched_tokens=256, long_prefill_token_threshold=32)
    sched.add_request(make_request("r0", 100))
    sched.add_request(make_request("r1", 10))
    assert step(sched).scheduled == {"r0": 32, "r1": 10}
    assert step(sched).scheduled == {"r0": 32, "r1": 1}
    assert step(sched).scheduled == {"r0": 32, "r1": 1}
    assert step(sched).scheduled == {"r0": 4, "r1": 1}


def test_max_num_seqs_bounds_running_requests():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=256)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 10, max_tokens=2))
    assert step(sched).scheduled == {"r0": 10, "r1": 10}
    assert step(sched).scheduled == {"r0": 1, "r1": 1}  # both finish here
    assert step(sched).scheduled == {"r2": 10}


def test_running_request_is_preempted_when_blocks_run_out_and_resumes():
    # 7 usable blocks; each 48-token prompt takes 3, so the 4th block each
    # needs at decode cannot be found for both.
    sched = make_scheduler(num_blocks=8, max_model_len=112, max_num_batched_tokens=128)
    sched.add_request(make_request("r0", 48, max_tokens=20))
    sched.add_request(make_request("r1", 48, max_tokens=20))
    s1 = step(sched)
    assert s1.scheduled == {"r0": 48, "r1": 48}
    assert free_blocks(sched) == 1
    s2 = step(sched)
    # r0 takes the last block; r1 needs one too: the last running request
    # (r1 itself) is preempted, and nobody is admitted in this step.
    assert s2.scheduled == {"r0": 1}
    assert s2.sched_out.preempted_req_ids == {"r1"}
    r1 = sched.requests["r1"]
    assert r1.status == RequestStatus.PREEMPTED
    assert r1.num_computed_tokens == 0 and r1.num_preemptions == 1
    assert r1.output_token_ids == [default_token(r1) - 7]
    assert free_blocks(sched) == 3
    tokens, reasons, steps = run_to_completion(sched)
    resumed = next(s for s in steps if "r1" in s.sched_out.scheduled_cached_reqs.resumed_req_ids)
    cached = resumed.sched_out.scheduled_cached_reqs
    assert cached.all_token_ids["r1"][-1] == r1.output_token_ids[0]
    # Resumed from the prefix cache, minus its tail block: r1's blocks were
    # freed tail first, so r0's fifth block evicted r1's third.
    assert resumed.scheduled["r1"] == 49 - 32
    assert len(tokens["r0"]) == 18 and len(tokens["r1"]) == 19  # after the first 2 steps
    # The same tokens as without preemption (the fake model is deterministic).
    assert r1.output_token_ids == [1001 + 7 * i for i in range(20)]
    assert reasons == {"r0": "length", "r1": "length"}
    assert free_blocks(sched) == 7
    assert sched.make_stats() is not None and sched.num_preemptions == 1


def test_preempted_request_recomputes_without_prefix_caching():
    sched = make_scheduler(
        num_blocks=8, max_model_len=112, max_num_batched_tokens=128, prefix_caching=False
    )
    sched.add_request(make_request("r0", 48, max_tokens=20))
    sched.add_request(make_request("r1", 48, max_tokens=20))
    step(sched)
    assert step(sched).sched_out.preempted_req_ids == {"r1"}
    _, _, steps = run_to_completion(sched)
    resumed = next(s for s in steps if "r1" in s.sched_out.scheduled_cached_reqs.resumed_req_ids)
    assert resumed.scheduled["r1"] == 49  # prompt + its one output, recomputed


def test_priority_preemption_takes_the_worst_priority_not_the_last():
    sched = make_scheduler(
        num_blocks=8, max_model_len=112, max_num_batched_tokens=128, policy="priority"
    )
    sched.add_request(make_request("r1", 32, priority=1, arrival_time=1, max_tokens=30))
    assert step(sched).scheduled == {"r1": 32}
    sched.add_request(make_request("r0", 32, priority=0, arrival_time=0, max_tokens=30))
    sched.add_request(make_request("r2", 32, priority=0, arrival_time=2, max_tokens=30))
    assert step(sched).scheduled == {"r1": 1, "r0": 32, "r2": 32}
    assert free_blocks(sched) == 0
    s3 = step(sched)
    # r0 needs a block: r1 (worst priority) is preempted although it was
    # scheduled earlier in this very step; its budget is given back.
    assert s3.sched_out.preempted_req_ids == {"r1"}
    assert s3.scheduled == {"r0": 1, "r2": 1}
    assert [r.request_id for r in sched.running] == ["r0", "r2"]


def test_fcfs_preemption_takes_the_last_running():
    sched = make_scheduler(num_blocks=8, max_model_len=112, max_num_batched_tokens=128)
    sched.add_request(make_request("r1", 32, max_tokens=30))
    step(sched)
    sched.add_request(make_request("r0", 32, max_tokens=30))
    sched.add_request(make_request("r2", 32, max_tokens=30))
    step(sched)
    s3 = step(sched)
    assert s3.sched_out.preempted_req_ids == {"r2"}
    assert s3.scheduled == {"r1": 1, "r0": 1}


def test_priority_queue_admits_higher_priority_first():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=256, policy="priority")
    sched.add_request(make_request("r0", 10, priority=5, arrival_time=0, max_tokens=1))
    sched.add_request(make_request("r1", 10, priority=1, arrival_time=1, max_tokens=1))
    sched.add_request(make_request("r2", 10, priority=1, arrival_time=2, max_tokens=1))
    order = [next(iter(step(sched).scheduled)) for _ in range(3)]
    assert order == ["r1", "r2", "r0"]


def test_prefix_hit_on_a_shared_prompt():
    sched = make_scheduler(max_num_batched_tokens=256)
    shared = list(range(500, 532))
    sched.add_request(make_request("r0", [*shared, *range(18)]))
    sched.add_request(make_request("r1", [*shared, *range(50, 60)]))
    s1 = step(sched)
    assert s1.scheduled == {"r0": 50, "r1": 10}
    new = {r.req_id: r for r in s1.sched_out.scheduled_new_reqs}
    assert new["r0"].block_ids == ([1, 2, 3, 4],)
    assert new["r1"].block_ids == ([1, 2, 5],)
    assert new["r1"].num_computed_tokens == 32
    assert sched.requests["r1"].num_cached_tokens == 32
    assert [b.ref_cnt for b in sched.kv_cache_manager.block_pool.blocks[1:6]] == [2, 2, 1, 1, 1]
    assert s1.stats is not None
    assert (s1.stats.prefix_cache_stats.queries, s1.stats.prefix_cache_stats.hits) == (92, 32)


@pytest.mark.parametrize(("prompt_len", "expect_scheduled"), [(49, 1), (48, 16)])
def test_full_prefix_hit_still_computes_the_last_token(prompt_len, expect_scheduled):
    sched = make_scheduler(max_num_batched_tokens=256)
    prompt = list(range(prompt_len))
    sched.add_request(make_request("r0", prompt, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("r1", prompt, max_tokens=1))
    s = step(sched)
    assert s.scheduled == {"r1": expect_scheduled}
    assert sched.kv_cache_manager.get_block_ids("r1") == ([],)  # finished and freed
    assert s.outputs[0].num_cached_tokens == prompt_len - expect_scheduled


def test_abort_waiting_running_and_preempted_requests():
    sched = make_scheduler(num_blocks=8, max_model_len=112, max_num_batched_tokens=128)
    sched.add_request(make_request("r0", 48, max_tokens=20))
    sched.add_request(make_request("r1", 48, max_tokens=20))
    step(sched)
    step(sched)  # r1 preempted
    sched.add_request(make_request("r2", 10))  # waiting, never scheduled
    assert sched.requests["r1"].status == RequestStatus.PREEMPTED
    sched.finish_requests(["r1", "r2", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert len(sched.waiting) == 0
    assert "r1" not in sched.requests and "r2" not in sched.requests
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert sched.running == []
    assert free_blocks(sched) == 7
    so = sched.schedule()
    assert so.finished_req_ids == {"r0", "r1", "r2"}
    assert so.num_scheduled_tokens == {}


def test_abort_during_a_step_drops_its_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("r0", 10))
    so = sched.schedule()
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    from engine.outputs import ModelRunnerOutput

    outs = sched.update_from_output(so, ModelRunnerOutput(["r0"], {"r0": 0}, [[5]]))
    assert not outs.outputs


def test_finish_requests_rejects_a_non_finished_status():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="finished_status"):
        sched.finish_requests("r0", RequestStatus.RUNNING)


def test_eos_stops_unless_ignore_eos():
    sched = make_scheduler()
    sched.add_request(make_request("r0", 5, max_tokens=10))
    sched.add_request(make_request("r1", 5, max_tokens=3, ignore_eos=True))
    tokens, reasons, _ = run_to_completion(sched, sample=lambda r: EOS)
    assert tokens == {"r0": [EOS], "r1": [EOS, EOS, EOS]}
    assert reasons == {"r0": "stop", "r1": "length"}


def test_stop_token_ids_record_the_stop_reason():
    sched = make_scheduler()
    req = make_request("r0", 5, max_tokens=10, stop_token_ids=[42])
    sched.add_request(req)
    seq = iter([7, 8, 42, 9])
    tokens, reasons, steps = run_to_completion(sched, sample=lambda r: next(seq))
    assert tokens == {"r0": [7, 8, 42]}
    assert reasons == {"r0": "stop"}
    assert steps[-1].outputs[0].stop_reason == 42


def test_min_tokens_suppresses_early_eos():
    sched = make_scheduler()
    sched.add_request(make_request("r0", 5, max_tokens=10, min_tokens=3))
    tokens, reasons, _ = run_to_completion(sched, sample=lambda r: EOS)
    assert tokens == {"r0": [EOS, EOS, EOS]} and reasons == {"r0": "stop"}


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=32)
    sched.add_request(make_request("r0", 28, max_tokens=100))
    tokens, reasons, _ = run_to_completion(sched)
    assert len(tokens["r0"]) == 4 and reasons == {"r0": "length"}


def test_multi_token_output_is_trimmed_at_the_stop():
    sched = make_scheduler()
    sched.add_request(make_request("r0", 5, max_tokens=10))
    step(sched)  # prefill + first token
    sched.update_draft_token_ids(DraftTokenIds(["r0"], [[11, 12, 13]]))
    s = step(sched, sample=lambda r: [11, EOS, 13, 14])
    assert s.scheduled == {"r0": 4}
    assert s.tokens("r0") == [11, EOS]
    assert s.finished() == {"r0": "stop"}


def test_rejected_drafts_rewind_num_computed_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("r0", 5, max_tokens=10))
    step(sched)
    req = sched.requests["r0"]
    assert (req.num_tokens, req.num_computed_tokens) == (6, 5)
    sched.update_draft_token_ids(DraftTokenIds(["r0"], [[11, 12, 13]]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r0": 4}
    assert so.scheduled_spec_decode_tokens == {"r0": [11, 12, 13]}
    assert req.num_computed_tokens == 9 and req.spec_token_ids == []
    from engine.outputs import ModelRunnerOutput

    # One draft accepted plus the bonus token: two drafts rejected.
    sched.update_from_output(so, ModelRunnerOutput(["r0"], {"r0": 0}, [[11, 77]]))
    assert req.num_computed_tokens == 7
    assert req.num_tokens == 8
    assert step(sched).scheduled == {"r0": 1}


def test_drafts_are_trimmed_to_the_budget():
    sched = make_scheduler(max_num_batched_tokens=3)
    sched.add_request(make_request("r0", 3, max_tokens=10))
    step(sched)
    sched.update_draft_token_ids(DraftTokenIds(["r0"], [[11, 12, 13, 14]]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r0": 3}
    assert so.scheduled_spec_decode_tokens == {"r0": [11, 12]}


def test_reset_prefix_cache_refuses_while_blocks_are_held_unless_forced():
    sched = make_scheduler(max_num_batched_tokens=256)
    sched.add_request(make_request("r0", 40, max_tokens=5))
    step(sched)
    assert sched.reset_prefix_cache() is False
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert sched.requests["r0"].status == RequestStatus.PREEMPTED
    assert free_blocks(sched) == 99
    assert len(sched.kv_cache_manager.block_pool.cached_blocks) == 0
    s = step(sched)
    assert s.scheduled == {"r0": 41}  # recomputed: nothing cached any more
    assert "r0" in s.sched_out.scheduled_cached_reqs.resumed_req_ids


def test_add_request_rejects_duplicates_and_overlong_prompts():
    sched = make_scheduler(max_model_len=64)
    sched.add_request(make_request("r0", 10))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("r0", 10))
    with pytest.raises(ValueError, match="max_model_len=64"):
        sched.add_request(make_request("r1", 65))
    assert sched.get_request_counts() == (0, 1)


def test_cache_smaller_than_one_request_is_refused():
    with pytest.raises(ConfigError, match="num_blocks"):
        make_scheduler(num_blocks=4, max_model_len=64)


def test_make_stats_reports_queues_usage_and_preemptions():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("r0", 32))
    sched.add_request(make_request("r1", 8))
    stats = step(sched).stats
    assert stats is not None
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(2 / 99)
    assert stats.num_preemptions == 0


def test_skipped_running_request_sends_its_tokens_again():
    # r1 is not scheduled in step 2 (budget spent); in step 3 the runner
    # gets its full token list because it may lack the latest token.
    sched = make_scheduler(max_num_batched_tokens=20, long_prefill_token_threshold=0)
    sched.add_request(make_request("r0", 30, max_tokens=5))
    sched.add_request(make_request("r1", 10, max_tokens=5))
    assert step(sched).scheduled == {"r0": 20}
    assert step(sched).scheduled == {"r0": 10, "r1": 10}
    s3 = step(sched)
    assert s3.scheduled == {"r0": 1, "r1": 1}
    assert s3.sched_out.scheduled_cached_reqs.all_token_ids == {}


def test_min_tokens_beyond_max_model_len_ends_at_the_limit():
    sched = make_scheduler(max_model_len=32)
    sched.add_request(make_request("r0", 30, max_tokens=10, min_tokens=5))
    tokens, reasons, _ = run_to_completion(sched, sample=lambda r: EOS)
    assert tokens == {"r0": [EOS, EOS]} and reasons == {"r0": "length"}


def test_kv_events_reach_the_step_outputs_when_enabled():
    from engine.config import CacheConfig, SchedulerConfig
    from engine.kv_cache.events import BlockRemoved, BlockStored
    from engine.outputs import ModelRunnerOutput
    from engine.sched.scheduler import Scheduler

    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=32),
        CacheConfig(block_size=16, num_blocks=3, enable_kv_events=True),
    )
    sched.add_request(make_request("r0", 20, max_tokens=1))
    so = sched.schedule()
    outs = sched.update_from_output(so, ModelRunnerOutput(["r0"], {"r0": 0}, [[5]]))
    events = outs.kv_events
    assert events is not None and len(events) == 1
    assert isinstance(events[0], BlockStored)
    assert events[0].token_ids == list(range(10_000, 10_016))  # r0's one full block
    sched.add_request(make_request("r1", 30, max_tokens=1))
    so = sched.schedule()  # needs both blocks: evicts r0's cached block
    outs = sched.update_from_output(so, ModelRunnerOutput(["r1"], {"r1": 0}, [[5]]))
    kinds = [type(e) for e in outs.kv_events or []]
    assert kinds == [BlockRemoved, BlockStored]


def test_logprobs_are_sliced_per_request_only_when_asked_for():
    from engine.outputs import LogprobsLists, ModelRunnerOutput

    sched = make_scheduler()
    sched.add_request(make_request("r0", 5, logprobs=1))
    sched.add_request(make_request("r1", 5))
    so = sched.schedule()
    lp = LogprobsLists([[7, 8], [9, 10]], [[-0.1, -2.0], [-0.3, -1.5]], [1, 1])
    outs = sched.update_from_output(
        so, ModelRunnerOutput(["r0", "r1"], {"r0": 0, "r1": 1}, [[7], [9]], logprobs=lp)
    )
    by_id = {o.request_id: o for o in outs.outputs}
    assert by_id["r0"].new_logprobs == LogprobsLists([[7, 8]], [[-0.1, -2.0]], [1])
    assert by_id["r1"].new_logprobs is None


def test_spec_decoding_stats_count_drafts_accepted_and_positions():
    from engine.outputs import ModelRunnerOutput
    from engine.sched.scheduler import Scheduler

    base = make_scheduler()
    sched = Scheduler(base.config, base.cache_config, num_spec_tokens=3)
    sched.add_request(make_request("r0", 5, max_tokens=20))
    step(sched)
    outcomes = [[11, 12, 77], [21, 99], [31, 32, 33, 34]]  # 2, 1 and 3 accepted
    for tokens in outcomes:
        drafts = tokens[:-1] + [0] * (3 - (len(tokens) - 1))
        sched.update_draft_token_ids(DraftTokenIds(["r0"], [drafts]))
        so = sched.schedule()
        sched.update_from_output(so, ModelRunnerOutput(["r0"], {"r0": 0}, [list(tokens)]))
    stats = sched.make_stats()
    assert stats is not None and stats.spec_decoding is not None
    spec = stats.spec_decoding
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (3, 9, 6)
    assert spec.num_accepted_tokens_per_pos == [3, 2, 1]
    assert spec.acceptance_rate == 6 / 9 and spec.mean_acceptance_length == 3.0
    # A snapshot: a later verifying step does not change a reported one.
    sched.update_draft_token_ids(DraftTokenIds(["r0"], [[41, 42, 43]]))
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["r0"], {"r0": 0}, [[5]]))
    assert spec.num_drafts == 3 and spec.num_accepted_tokens_per_pos == [3, 2, 1]
    later = sched.make_stats()
    assert later is not None and later.spec_decoding is not None
    assert later.spec_decoding.num_drafts == 4 and later.spec_decoding.num_draft_tokens == 12
    assert make_scheduler().make_stats().spec_decoding is None  # type: ignore[union-attr]


def test_spec_decoding_stats_count_only_drafts_the_runner_verified():
    """Asynchronous scheduling plans placeholders; the runner says how many
    real drafts stood in for them. Stats count those (a step with none is no
    verifying step), while progress is rewound for every planned one."""
    from engine.outputs import ModelRunnerOutput
    from engine.sched.scheduler import Scheduler

    base = make_scheduler()
    sched = Scheduler(base.config, base.cache_config, num_spec_tokens=3)
    req = make_request("r0", 5, max_tokens=20)
    sched.add_request(req)
    step(sched)
    for verified, tokens in ((2, [11, 12, 13]), (0, [21]), (1, [31])):
        sched.update_draft_token_ids(DraftTokenIds(["r0"], [[7, 7, 7]]))
        so = sched.schedule()
        runner_output = ModelRunnerOutput(
            ["r0"], {"r0": 0}, [tokens], num_verified_drafts={"r0": verified}
        )
        sched.update_from_output(so, runner_output)
        assert req.num_computed_tokens == req.num_tokens - 1
    stats = sched.make_stats()
    assert stats is not None and stats.spec_decoding is not None
    spec = stats.spec_decoding
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (2, 3, 2)
