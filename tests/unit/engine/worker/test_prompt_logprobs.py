"""Prompt logprobs in the model runner: the rows each prefill chunk covers.

The model is the recording double of test_model_runner (logits favour
token last input id + 1), so every prompt token's logprob and rank are known:
``LIKELY`` when it follows its predecessor by one, ``UNLIKELY`` otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.sched.output import NewRequestData
from engine.worker import prompt_logprobs
from tests.unit.engine.worker.test_model_runner import VOCAB, cached, make_runner, step

LIKELY = 1 - math.log(math.e + VOCAB - 1)
UNLIKELY = -math.log(math.e + VOCAB - 1)


def params(prompt_logprobs: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=prompt_logprobs)


def test_each_chunk_gives_the_rows_of_the_tokens_after_its_positions():
    runner, _ = make_runner()
    a = NewRequestData("a", [10, 11, 12, 20, 14, 15], params(1), ([7, 3],), 0)
    b = NewRequestData("b", [20, 21, 22], params(None), ([5],), 0)
    out = runner.execute_model(step([a, b], scheduled={"a": 4, "b": 3}))
    assert list(out.prompt_logprobs_dict) == ["a"]  # b asked for none
    chunk = out.prompt_logprobs_dict["a"]
    assert chunk.first_token == 1 and chunk.num_tokens == 4  # tokens 11, 12, 20, 14
    lists = chunk.logprobs
    assert [row[0] for row in lists.logprob_token_ids] == [11, 12, 20, 14]
    assert [row[1] for row in lists.logprob_token_ids] == [11, 12, 13, 21]  # the top-1
    assert lists.sampled_token_ranks == [1, 1, 2, 2]
    assert [row[0] for row in lists.logprobs] == pytest.approx([LIKELY, LIKELY, UNLIKELY, UNLIKELY])
    assert [row[1] for row in lists.logprobs] == pytest.approx([LIKELY] * 4)
    assert out.sampled_token_ids == [[], [23]]  # b's sample is untouched

    # The last chunk: position 5's logits sample; only position 4 has a target.
    out = runner.execute_model(
        step(cached=cached(["a", "b"], [4, 3], [None, None]), scheduled={"a": 2, "b": 1})
    )
    chunk = out.prompt_logprobs_dict["a"]
    assert (chunk.first_token, chunk.logprobs.logprob_token_ids) == (5, [[15, 15]])
    assert out.sampled_token_ids == [[16], [24]]
    # Done: decode steps compute none.
    out = runner.execute_model(
        step(cached=cached(["a", "b"], [6, 4], [None, None]), scheduled={"a": 1, "b": 1})
    )
    assert out.prompt_logprobs_dict == {}
    assert not runner.prompt_logprobs


def test_zero_top_keeps_only_the_prompt_token_and_one_token_prompts_have_none():
    runner, _ = make_runner()
    a = NewRequestData("a", [3, 4, 9], params(0), ([1],), 0)
    b = NewRequestData("b", [5], params(3), ([2],), 0)
    out = runner.execute_model(step([a, b], scheduled={"a": 3, "b": 1}))
    assert list(out.prompt_logprobs_dict) == ["a"]
    lists = out.prompt_logprobs_dict["a"].logprobs
    assert lists.logprob_token_ids == [[4], [9]] and lists.sampled_token_ranks == [1, 2]


def test_a_request_preempted_mid_prefill_gives_its_rows_again():
    runner, _ = make_runner()
    a = NewRequestData("a", [1, 2, 3, 4, 5], params(0), ([1],), 0)
    out = runner.execute_model(step([a], scheduled={"a": 3}))
    assert out.prompt_logprobs_dict["a"].first_token == 1
    # Preempted, then resumed from scratch with new blocks.
    resumed = cached(["a"], [0], [[2, 3]], resumed=["a"], all_tokens={"a": [1, 2, 3, 4, 5]})
    out = runner.execute_model(step(cached=resumed, scheduled={"a": 5}))
    chunk = out.prompt_logprobs_dict["a"]
    assert chunk.first_token == 1
    assert [row[0] for row in chunk.logprobs.logprob_token_ids] == [2, 3, 4, 5]


def test_a_finished_request_is_forgotten():
    runner, _ = make_runner()
    a = NewRequestData("a", [1, 2, 3, 4, 5], params(0), ([1],), 0)
    runner.execute_model(step([a], scheduled={"a": 2}))
    assert runner.prompt_logprobs
    runner.execute_model(step(finished=["a"]))
    assert not runner.prompt_logprobs


def test_full_vocabulary_logits_exist_for_a_few_rows_at_a_time(monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_PASS", 2)
    runner, model = make_runner()
    sizes: list[int] = []
    compute: Callable[[torch.Tensor], torch.Tensor] = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        sizes.append(hidden.shape[0])
        return compute(hidden)

    model.compute_logits = recording  # type: ignore[method-assign]
    prompt = [10, 11, 12, 20, 14, 15, 30]
    a = NewRequestData("a", prompt, params(2), ([1, 2],), 0)
    out = runner.execute_model(step([a], scheduled={"a": 7}))
    assert sizes == [2, 2, 2, 1]  # six prompt rows in passes of two, then the sample
    lists = out.prompt_logprobs_dict["a"].logprobs
    assert [row[0] for row in lists.logprob_token_ids] == prompt[1:]
    assert lists.sampled_token_ranks == [1, 1, 2, 2, 1, 2]
    assert all(len(row) == 3 for row in lists.logprob_token_ids)
