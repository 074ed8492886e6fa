"""Greedy outputs of the LLM API on the default model are token-identical to
transformers' generate(), with chunked prefill, prefix caching and
preemption each forced in turn: on the exact path (``exact=True``: float
activations, a float32 KV cache), which the default model's fast default
(int8 activations, a bfloat16 cache; engine/numerics.py) is not."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(hf_model, chat_prompts) -> list[list[int]]:
    results = []
    with torch.inference_mode():
        for ids in chat_prompts:
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


def test_prompts_have_mixed_lengths(chat_prompts):
    lengths = sorted(len(p) for p in chat_prompts)
    assert lengths[-1] - lengths[0] >= 30


def test_plain(chat_prompts, expected):
    llm = LLM(enable_prefix_caching=False, exact=True)
    assert _generate(llm, chat_prompts) == expected
    assert llm.totals.num_preemptions == 0


def test_chunked_prefill_forced(chat_prompts, expected):
    # A budget smaller than every prompt: each prefill spans several steps.
    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=24, exact=True)
    assert min(len(p) for p in chat_prompts) > 24
    assert _generate(llm, chat_prompts) == expected


def test_prefix_caching_with_shared_system_prompt(chat_prompts, expected):
    llm = LLM(enable_prefix_caching=True, exact=True)
    assert _generate(llm, chat_prompts[:1]) == expected[:1]  # warms the cache
    outs = llm.generate(chat_prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
    assert llm.totals.prefix_cache_hits > 0
    assert all(o.num_cached_tokens > 0 for o in outs)


def test_tiny_kv_cache_preempts_and_resumes(chat_prompts, expected):
    # 20 usable blocks of 16 tokens for eight requests of 45-79 prompt tokens
    # plus 24 generated:
    # they cannot all stay resident, so some are preempted and recomputed.
    llm = LLM(enable_prefix_caching=False, max_model_len=256, num_blocks_override=21, exact=True)
    assert llm.totals.num_preemptions == 0
    assert _generate(llm, chat_prompts) == expected
    assert llm.totals.num_preemptions > 0
