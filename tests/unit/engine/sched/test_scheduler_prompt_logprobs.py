"""The scheduler's side of prompt logprobs: no prefix-cache reads for such a
request, and each step's prompt logprobs passed on, mid-prefill too."""

from __future__ import annotations

from engine.outputs import LogprobsLists, ModelRunnerOutput, PromptLogprobs
from tests.unit.engine.sched.harness import make_request, make_scheduler, run_to_completion, step


def test_a_prompt_logprobs_request_reads_no_prefix_cache_but_fills_it():
    sched = make_scheduler(max_num_batched_tokens=256)
    prompt = list(range(48))
    sched.add_request(make_request("r0", prompt, max_tokens=1))
    run_to_completion(sched)
    cached = set(sched.kv_cache_manager.block_pool.blocks[1:4])
    assert all(b.block_hash is not None for b in cached)

    sched.add_request(make_request("r1", prompt, max_tokens=1, prompt_logprobs=2))
    s1 = step(sched)
    assert s1.scheduled == {"r1": 48}  # the whole prompt, though 32 tokens were cached
    assert s1.sched_out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert s1.outputs[0].num_cached_tokens == 0
    (r1_blocks,) = s1.sched_out.scheduled_new_reqs[0].block_ids
    assert not set(r1_blocks) & {b.block_id for b in cached}

    # What it computed is cached for others (beside r0's copy).
    sched.add_request(make_request("r2", prompt, max_tokens=1))
    s2 = step(sched)
    assert s2.scheduled == {"r2": 16}
    assert s2.outputs[0].num_cached_tokens == 32


def test_a_preempted_prompt_logprobs_request_recomputes_its_whole_prompt():
    sched = make_scheduler(num_blocks=8, max_model_len=112, max_num_batched_tokens=128)
    sched.add_request(make_request("r0", 48, max_tokens=20))
    sched.add_request(make_request("r1", 48, max_tokens=20, prompt_logprobs=0))
    step(sched)
    assert step(sched).sched_out.preempted_req_ids == {"r1"}
    _, _, steps = run_to_completion(sched)
    resumed = next(s for s in steps if "r1" in s.sched_out.scheduled_cached_reqs.resumed_req_ids)
    assert resumed.scheduled["r1"] == 49  # prompt + its token: no prefix hit


def _chunk(first_token: int, ids: list[int]) -> PromptLogprobs:
    return PromptLogprobs(first_token, LogprobsLists([[t] for t in ids], [[-1.0]] * len(ids), [1]))


def test_prompt_logprobs_go_out_mid_prefill_and_with_the_first_token():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("r0", list(range(40)), prompt_logprobs=0))
    sched.add_request(make_request("r1", 40))  # asks for none
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r0": 32}
    first = _chunk(1, list(range(1, 33)))
    outs = sched.update_from_output(
        so, ModelRunnerOutput(["r0"], {"r0": 0}, [[]], prompt_logprobs_dict={"r0": first})
    )
    (out,) = outs.outputs
    assert (out.request_id, out.new_token_ids, out.finished) == ("r0", [], False)
    assert out.new_prompt_logprobs is first and out.num_cached_tokens == 0

    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r0": 8, "r1": 24}
    rest = _chunk(33, list(range(33, 40)))
    runner_out = ModelRunnerOutput(
        ["r0", "r1"], {"r0": 0, "r1": 1}, [[7], []], prompt_logprobs_dict={"r0": rest}
    )
    (out,) = sched.update_from_output(so, runner_out).outputs  # r1 is mid-prefill: silent
    assert out.new_token_ids == [7] and out.new_prompt_logprobs is rest
    # Later steps have none for it.
    so = sched.schedule()
    runner_out = ModelRunnerOutput(["r0", "r1"], {"r0": 0, "r1": 1}, [[8], []])
    (out,) = sched.update_from_output(so, runner_out).outputs
    assert out.new_prompt_logprobs is None
