"""Asynchronous scheduling on the default model: greedy outputs are
token-identical to the synchronous engine's with prefix caching, chunked
prefill and preemption, speculative decoding (both proposers: the drafts
the scheduler plans are placeholders the runner fills), structured output
(masks wait for the token in flight) and stop strings (tokens sampled after
a stop never reach the caller)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.config import SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutputParams

SHARED = "You are a careful assistant. Answer briefly and precisely. " * 4
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    SHARED + "What is the capital of France?",
    SHARED + "Name three primary colors.",
    "Count: one, two, three, four, five, six, seven, eight, nine, ten, one, two, three,",
    "Once upon a time, in a small village by the river,",
    "Explain in one sentence why the sky is blue.",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _generate(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def sync_llm(plain_llm: LLM) -> LLM:
    return plain_llm


@pytest.fixture(scope="module")
def reference(sync_llm: LLM) -> list[list[int]]:
    return _generate(sync_llm)


def _async_llm(**overrides: Any) -> LLM:
    overrides.setdefault("max_model_len", 512)
    llm = LLM(async_scheduling=True, **overrides)
    assert llm.core.pipeline is not None
    return llm


@pytest.fixture(scope="module")
def async_llm() -> LLM:
    return _async_llm()


def test_greedy_outputs_equal_the_synchronous_engine(
    async_llm: LLM, reference: list[list[int]]
) -> None:
    assert _generate(async_llm) == reference
    # Again: the shared prefix now comes from the prefix cache.
    assert _generate(async_llm) == reference
    assert async_llm.totals.prefix_cache_hits > 0


def test_chunked_prefill_and_preemption(reference: list[list[int]]) -> None:
    # 24 blocks of 16 tokens for 8 requests of up to ~90 tokens: preemption.
    llm = _async_llm(max_model_len=128, max_num_batched_tokens=48, num_blocks_override=25)
    assert _generate(llm) == reference
    assert llm.totals.num_preemptions > 0
    llm.core.shutdown()


def test_draft_model_speculative_decoding(
    reference: list[list[int]], default_model_path: Path
) -> None:
    """The draft model's placeholders under asynchronous scheduling (n-gram
    drafts: the next test)."""
    # Fixed k: every draft verified (adaptive drafting turns a CPU self-draft off).
    spec = SpeculativeConfig(
        method="draft_model",
        model=str(default_model_path),
        num_speculative_tokens=3,
        adaptive=False,
    )
    llm = _async_llm(speculative=spec)
    assert _generate(llm) == reference
    stats = llm.totals.spec_decoding
    assert stats is not None and stats.num_accepted_tokens > 0
    llm.core.shutdown()


def test_ngram_drafts_alone_keep_the_synchronous_tokens_and_acceptance(
    sync_llm: LLM, reference: list[list[int]]
) -> None:
    """One request at a time (where a wrong rewind of unused placeholder
    drafts once garbled the output): the synchronous tokens, and the same
    drafts verified and accepted as the synchronous engine's; then the
    whole batch at once."""
    # Fixed k (adaptive drafting would decide by each engine's own timings).
    spec = SpeculativeConfig(num_speculative_tokens=4, adaptive=False)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[2], PROMPTS[5]]
    expected = [list(sync_llm.generate([p], params, use_tqdm=False)[0].token_ids) for p in prompts]
    stats = []
    for llm in (LLM(max_model_len=512, speculative=spec), _async_llm(speculative=spec)):
        got = [list(llm.generate([p], params, use_tqdm=False)[0].token_ids) for p in prompts]
        assert got == expected
        stats.append(llm.totals.spec_decoding)
    assert _generate(llm) == reference  # the asynchronous one, batched
    llm.core.shutdown()
    sync, async_ = stats
    assert sync is not None and async_ is not None and sync.num_accepted_tokens > 0
    assert async_.num_draft_tokens == pytest.approx(sync.num_draft_tokens, rel=0.1)
    assert async_.acceptance_rate == pytest.approx(sync.acceptance_rate, rel=0.1)


def test_structured_output(sync_llm: LLM, async_llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"enum": ["France", "Japan", "Other"]},
        },
        "required": ["city", "country"],
    }
    params = SamplingParams(
        max_tokens=96,
        temperature=0.0,
        structured_outputs=StructuredOutputParams(json=json.dumps(schema)),
    )
    prompts = ["Describe Paris as JSON:", "Describe Tokyo as JSON:"]
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in expected]
    for out in got:
        assert out.finish_reason == "stop", out.text  # the grammar completed
        assert set(json.loads(out.text)) == {"city", "country"}


def test_stop_strings_drop_what_follows(sync_llm: LLM, async_llm: LLM) -> None:
    params = SamplingParams(max_tokens=32, temperature=0.0, stop=[" the", "\n"])
    expected = sync_llm.generate(PROMPTS, params, use_tqdm=False)
    got = async_llm.generate(PROMPTS, params, use_tqdm=False)
    for e, g in zip(expected, got, strict=True):
        assert (g.text, list(g.token_ids), g.finish_reason) == (
            e.text,
            list(e.token_ids),
            e.finish_reason,
        )
    assert any(g.finish_reason == "stop" and len(g.token_ids) < 32 for g in got)
