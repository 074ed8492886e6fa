"""Sampling, stops and input errors through the LLM API on the default model."""

from __future__ import annotations

import dataclasses

import pytest

from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPT = "The history of bread begins"
OTHERS = ["Once upon a time", "The three primary colours are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(plain_llm: LLM) -> LLM:
    return plain_llm


def _greedy(llm: LLM, prompt: str, **kw) -> tuple[str, list[int]]:
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32, **kw))[0]
    return out.text, out.token_ids


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate(PROMPT, params)[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=24)
    mixed = llm.generate([*OTHERS, PROMPT], [unseeded] * 3 + [params])[3].token_ids
    first = llm.generate([PROMPT, *OTHERS], [params] + [unseeded] * 3)[0].token_ids
    assert alone == mixed == first
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24)
    assert llm.generate(PROMPT, other_seed)[0].token_ids != alone


def test_max_tokens_ends_with_length(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_stop_string_ends_generation_and_is_trimmed(llm):
    text, _ = _greedy(llm, PROMPT)
    words = [w for w in text.split() if len(w) >= 3]
    stop = words[len(words) // 2]
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=32, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_stop_token_id_ends_generation(llm):
    _, ids = _greedy(llm, PROMPT)
    position = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    stop_id = ids[position]
    out = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert out.token_ids == ids[: position + 1]


def test_logprobs_of_greedy_tokens_rank_first(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry.token_id == token_id
        assert entry.rank == 1
        assert len(entry.top) == 3
        assert entry.logprob <= 0.0
        assert max(entry.top.values()) == pytest.approx(entry.logprob, abs=1e-5)


def test_chat_prompt_uses_the_chat_template(llm):
    text = llm.chat_prompt([{"role": "user", "content": "Hi"}])
    assert "Hi" in text and text != "Hi"


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ("", "prompt"),
        ([], "prompt_token_ids"),
        ([10**9], "prompt_token_ids"),
        ([1] * 600, "prompt"),
    ],
)
def test_bad_input_names_the_field_and_leaves_the_engine_usable(llm, prompt, field):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([PROMPT, prompt], SamplingParams(max_tokens=4))
    assert info.value.field == field
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_repetition_penalty_repeats_less_and_companions_are_unchanged(llm):
    prompt = "Repeat after me: one two one two one two"
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    penalized = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.8
    )
    base, other_alone = llm.generate([prompt, PROMPT], plain)
    assert _repeats(base.token_ids) > 10  # the small model loops without it
    # Batched together: the penalty changes its row only.
    pen, other = llm.generate([prompt, PROMPT], [penalized, plain])
    assert pen.token_ids != base.token_ids
    assert _repeats(pen.token_ids) < _repeats(base.token_ids)
    assert other.token_ids == other_alone.token_ids


def test_frequency_and_presence_penalties_discourage_the_outputs_own_tokens(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = llm.generate(PROMPT, plain)[0].token_ids
    for params in (
        dataclasses.replace(plain, frequency_penalty=2.0),
        dataclasses.replace(plain, presence_penalty=2.0),
    ):
        ids = llm.generate(PROMPT, params)[0].token_ids
        assert ids != base and _repeats(ids) < _repeats(base), params


def test_logit_bias_forces_a_token_and_bans_another(llm):
    _, ids = _greedy(llm, PROMPT)
    forced = 12345
    params = SamplingParams(
        temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0}
    )
    assert llm.generate(PROMPT, params)[0].token_ids == [forced] * 6
    banned = ids[0]
    out = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=8, logit_bias={banned: -100.0})
    )[0]
    assert banned not in out.token_ids and out.token_ids[0] != ids[0]


def test_min_p_sampling_is_seeded_and_a_bad_bias_id_is_refused(llm):
    params = SamplingParams(temperature=1.0, min_p=0.1, seed=7, max_tokens=16, ignore_eos=True)
    first = llm.generate(PROMPT, params)[0].token_ids
    assert llm.generate([*OTHERS, PROMPT], [params] * 4)[3].token_ids == first
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(PROMPT, SamplingParams(logit_bias={49152: 1.0}))
    assert info.value.field == "logit_bias"
