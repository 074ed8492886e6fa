"""Sampling, stops and input errors through the LLM API on the default model."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPT = "The history of bread begins"
OTHERS = ["Once upon a time", "The three primary colours are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512)


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
