"""Greedy outputs of the LLM API on the default model are token-identical to
transformers' greedy generate() (checked by teacher forcing), with chunked
prefill, prefix caching and preemption each forced in turn: on the exact path (``exact=True``: float
activations, a float32 KV cache), which the default model's fast default
(int8 activations, a bfloat16 cache; engine/numerics.py) is not."""

from __future__ import annotations

from typing import Any

import pytest

from engine.llm import LLM
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from tests.e2e.teacher_forcing import greedy_mismatches

MAX_TOKENS = 24


class Reference:
    """transformers' greedy tokens, checked by teacher forcing
    (tests/e2e/teacher_forcing.py): one forward pass per prompt over the
    prompt and Tandem's output, not a generate() of MAX_TOKENS steps. An
    output already checked for its prompt (each configuration below should
    produce the same) is not run again; a different one is, and at its first
    differing token at most one of the two can be transformers' argmax."""

    def __init__(self, model: Any, prompts: list[list[int]]) -> None:
        self.model = model
        self.prompts = prompts
        eos = model.generation_config.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or ())
        self.checked: dict[int, list[int]] = {}  # prompt index -> its checked output

    def check(self, outs: list[RequestOutput], indices: list[int] | None = None) -> None:
        """`outs[k]` answers prompt `indices[k]` (all the prompts in order by
        default) and is what transformers' generate() would produce: its
        greedy tokens, ending where transformers' EOS ends them or at
        MAX_TOKENS."""
        indices = list(range(len(self.prompts))) if indices is None else indices
        assert len(outs) == len(indices)
        for o in outs:
            assert o.finished and o.finish_reason in ("stop", "length"), o.finish_reason
            assert not self.eos & set(o.token_ids[:-1])  # generate() stops at the first
            if o.finish_reason == "stop":
                assert o.token_ids and o.token_ids[-1] in self.eos
            else:
                assert len(o.token_ids) == MAX_TOKENS
        new = [(i, list(o.token_ids)) for i, o in zip(indices, outs, strict=True)]
        new = [(i, t) for i, t in new if self.checked.get(i) != t]
        if new:
            prompts = [self.prompts[i] for i, _ in new]
            mismatches = greedy_mismatches(self.model, prompts, [t for _, t in new])
            assert not mismatches, "\n".join(mismatches)
            self.checked.update(new)


@pytest.fixture(scope="module")
def reference(hf_model, chat_prompts) -> Reference:
    return Reference(hf_model, chat_prompts)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[RequestOutput]:
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))


def test_prompts_have_mixed_lengths(chat_prompts):
    lengths = sorted(len(p) for p in chat_prompts)
    assert lengths[-1] - lengths[0] >= 30


def test_plain(chat_prompts, reference):
    llm = LLM(enable_prefix_caching=False, exact=True)
    reference.check(_generate(llm, chat_prompts))
    assert llm.totals.num_preemptions == 0


def test_chunked_prefill_forced(chat_prompts, reference):
    # A budget smaller than every prompt: each prefill spans several steps.
    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=24, exact=True)
    assert min(len(p) for p in chat_prompts) > 24
    reference.check(_generate(llm, chat_prompts))


def test_prefix_caching_with_shared_system_prompt(chat_prompts, reference):
    llm = LLM(enable_prefix_caching=True, exact=True)
    reference.check(_generate(llm, chat_prompts[:1]), [0])  # warms the cache
    outs = _generate(llm, chat_prompts)
    reference.check(outs)
    assert llm.totals.prefix_cache_hits > 0
    assert all(o.num_cached_tokens > 0 for o in outs)


def test_tiny_kv_cache_preempts_and_resumes(chat_prompts, reference):
    # 20 usable blocks of 16 tokens for eight requests of 45-79 prompt tokens
    # plus 24 generated:
    # they cannot all stay resident, so some are preempted and recomputed.
    llm = LLM(enable_prefix_caching=False, max_model_len=256, num_blocks_override=21, exact=True)
    assert llm.totals.num_preemptions == 0
    reference.check(_generate(llm, chat_prompts))
    assert llm.totals.num_preemptions > 0
