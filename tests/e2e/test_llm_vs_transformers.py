"""Greedy outputs of the LLM API on the default model are token-identical to
transformers' generate(), with chunked prefill, prefix caching and
preemption each forced in turn."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

MAX_TOKENS = 24
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one or two short "
    "sentences, name prices in euros, and never invent opening hours."
)
QUESTIONS = [
    "Hi!",
    "What is bread made of?",
    "Give me three names for a sourdough starter.",
    "Explain, step by step and in detail, how to fold croissant dough so that the "
    "layers of butter stay separate, and what goes wrong when the kitchen is too warm.",
    "Count from one to ten.",
    "Is rye flour gluten free?",
    "Write a haiku about an oven at dawn, then explain the imagery you chose, the "
    "season it evokes, and why bakers start so early in the morning.",
    "What is 12 times 7?",
]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Eight chat prompts of mixed length sharing one system prompt."""
    out = []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text))
    return out


@pytest.fixture(scope="module")
def expected(hf_model, prompts) -> list[list[int]]:
    results = []
    with torch.inference_mode():
        for ids in prompts:
            gen = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=hf_model.config.eos_token_id,
            )
            results.append(gen[0, len(ids) :].tolist())
    return results


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert all(o.finished and o.finish_reason in ("stop", "length") for o in outs)
    return [o.token_ids for o in outs]


def test_prompts_have_mixed_lengths(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert lengths[-1] - lengths[0] >= 30


def test_plain(prompts, expected):
    llm = LLM(enable_prefix_caching=False)
    assert _generate(llm, prompts) == expected
    assert llm.totals.num_preemptions == 0


def test_chunked_prefill_forced(prompts, expected):
    # A budget smaller than every prompt: each prefill spans several steps.
    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=24)
    assert min(len(p) for p in prompts) > 24
    assert _generate(llm, prompts) == expected


def test_prefix_caching_with_shared_system_prompt(prompts, expected):
    llm = LLM(enable_prefix_caching=True)
    assert _generate(llm, prompts[:1]) == expected[:1]  # warms the cache
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
    assert llm.totals.prefix_cache_hits > 0
    assert all(o.num_cached_tokens > 0 for o in outs)


def test_tiny_kv_cache_preempts_and_resumes(prompts, expected):
    # 20 usable blocks of 16 tokens for eight requests of 45-79 prompt tokens
    # plus 24 generated:
    # they cannot all stay resident, so some are preempted and recomputed.
    llm = LLM(enable_prefix_caching=False, max_model_len=256, num_blocks_override=21)
    assert llm.totals.num_preemptions == 0
    assert _generate(llm, prompts) == expected
    assert llm.totals.num_preemptions > 0
