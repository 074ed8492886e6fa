"""Speculative decoding on the default model: greedy outputs are
token-identical to the non-speculative ones with either proposer, under
chunked prefill, preemption and prefix caching; stops inside an accepted
run end exactly where the plain run ends; constrained requests stay valid.

On the exact path (``exact=True``): on the default model's fast default
(int8 activations, a bfloat16 KV cache) verifying k + 1 tokens in one
forward is not bit-identical to decoding them one by one, so greedy
outputs may part at a near tie (measured: one prompt of six from its 20th
token)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutputParams

PASSAGE = (
    "The committee met on Tuesday to review the budget. After a long discussion, "
    "the members agreed to fund the new library and to repair the old bridge."
)
SHARED = "You are a careful assistant. Answer briefly and precisely. " * 4
PROMPTS = [
    f"Repeat the passage exactly.\nPassage: {PASSAGE}\nRepeat: {PASSAGE[:40]}",
    "def add(a, b):\n    return a + b\n\n# The same function, renamed to plus:\ndef plus(a, b):",
    "Write a short poem about the sea.",
    SHARED + "What is the capital of France?",
    SHARED + "Name three primary colors.",
    "Count: one, two, three, four, five, six, seven, eight, nine, ten, one, two, three,",
]
# ignore_eos: every request generates all its tokens (several would end at once).
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
K = 4


def _generate(
    llm: LLM, params: SamplingParams = GREEDY, prompts: list[str] = PROMPTS
) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def base(exact_llm: LLM) -> LLM:
    return exact_llm


@pytest.fixture(scope="module")
def reference(base: LLM) -> list[list[int]]:
    return _generate(base)


@pytest.fixture(scope="module")
def self_draft(default_model_path: Path) -> LLM:
    # Every draft verified (on a CPU the adaptive policy would turn a draft
    # model as dear as the target off): these tests are about verification.
    spec = SpeculativeConfig(
        method="draft_model",
        model=str(default_model_path),
        num_speculative_tokens=K,
        adaptive=False,
    )
    return LLM(max_model_len=512, speculative=spec, exact=True)


@pytest.fixture(scope="module")
def tiny_draft_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """A 2-layer random-weight Llama with the default model's vocabulary."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    target = AutoConfig.from_pretrained(default_model_path)
    config = LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=target.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-draft")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("adaptive", [True, False])
def test_ngram_greedy_identical_under_chunking_preemption_and_prefix_caching(
    reference: list[list[int]], adaptive: bool
) -> None:
    # adaptive: only the drafts that pay are sent (engine/spec_decode/adaptive.py).
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, adaptive=adaptive)
    # 18 blocks of 16 for six requests of 35-90 tokens: preemption; a
    # 48-token budget: long prompts are chunked; SHARED is a cached prefix.
    llm = LLM(
        max_model_len=256,
        num_blocks_override=18,
        max_num_batched_tokens=48,
        speculative=spec,
        exact=True,
    )
    assert _generate(llm) == reference
    stats = llm.core.scheduler.spec_stats
    assert stats is not None
    # Adaptive drafts are sent only where this machine's measured step costs
    # say they pay: on a loaded machine possibly none, so only the
    # non-adaptive run must have verified some.
    assert adaptive or stats.num_accepted_tokens > 0
    totals = llm.totals
    assert totals.num_preemptions > 0
    assert totals.prefix_cache_hits > 0


def test_self_draft_accepts_nearly_everything(self_draft: LLM, reference: list[list[int]]) -> None:
    assert _generate(self_draft) == reference
    stats = self_draft.core.scheduler.spec_stats
    assert stats is not None
    assert stats.acceptance_rate > 0.9, stats


def test_random_draft_accepts_little_changes_nothing(
    tiny_draft_path: Path, reference: list[list[int]]
) -> None:
    # Verifying drafts that fail costs a CPU k+1 tokens' compute per step:
    # few drafts and three requests (in 9 usable blocks: preemption).
    spec = SpeculativeConfig(
        method="draft_model", model=str(tiny_draft_path), num_speculative_tokens=2, adaptive=False
    )
    llm = LLM(max_model_len=144, num_blocks_override=10, speculative=spec, exact=True)
    assert _generate(llm, prompts=PROMPTS[:3]) == reference[:3]
    stats = llm.core.scheduler.spec_stats
    assert stats is not None and stats.num_drafts > 0
    assert stats.acceptance_rate < 0.5, stats
    assert llm.totals.num_preemptions > 0


def test_stops_inside_an_accepted_run_end_where_the_plain_run_ends(
    base: LLM, self_draft: LLM, reference: list[list[int]], tokenizer
) -> None:
    tokens = reference[0]
    text = tokenizer.decode(tokens)
    stop_string = text[len(text) // 2 : len(text) // 2 + 6]
    cases = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop_string]),
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[tokens[11]]),
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
    ]
    for params in cases:
        want = base.generate(PROMPTS[:1], params, use_tqdm=False)[0]
        got = self_draft.generate(PROMPTS[:1], params, use_tqdm=False)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
        ), params
    # max_model_len: a prompt 5 tokens short of it ends after 5 tokens.
    long_prompt = tokenizer.encode(PASSAGE * 40)[: 512 - 5]
    want = base.generate([long_prompt], GREEDY, use_tqdm=False)[0]
    got = self_draft.generate([long_prompt], GREEDY, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 5


def test_structured_output_with_drafts_is_valid_and_identical(base: LLM, self_draft: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=32,
        temperature=0.0,
        structured_outputs=StructuredOutputParams(json=schema),
    )
    prompts = ["Give a city and its rank as JSON: ", PROMPTS[3]]
    want = base.generate(prompts, params, use_tqdm=False)
    got = self_draft.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for output in got:
        data = json.loads(output.text)
        assert set(data) == {"city", "rank"}


def test_logprobs_penalties_and_seeds_with_drafts(base: LLM, self_draft: LLM) -> None:
    prompt = PROMPTS[:1]
    # Logprobs: one entry per token, the values the plain run reports.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    want = base.generate(prompt, params, use_tqdm=False)[0]
    got = self_draft.generate(prompt, params, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs is not None and want.logprobs is not None
    assert [e.token_id for e in got.logprobs] == got.token_ids
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert g.rank == w.rank and set(g.top) == set(w.top)
        assert g.logprob == pytest.approx(w.logprob, abs=1e-3)
    # Penalties: each draft position counts the drafts before it as output.
    params = SamplingParams(
        max_tokens=16,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    )
    want = base.generate(prompt, params, use_tqdm=False)[0]
    got = self_draft.generate(prompt, params, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids
    # A seeded sampled request is reproducible with drafts too.
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    runs = [self_draft.generate(prompt, params, use_tqdm=False)[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


JSON_COPY = {"name": "Ada", "age": 36, "languages": ["en", "fr"], "active": True, "id": "x-17"}
COPY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_grammars_with_drafts_end_at_the_grammar_and_never_the_engine(
    base: LLM, tiny_draft_path: Path
) -> None:
    """A draft that completes the grammar (its closing brace, then the stop
    token) once asked the finished grammar for another mask: xgrammar
    raised and every later call on the LLM failed. With n-gram drafts (which
    copy the JSON and its stop token) and a draft model (a small random
    one: the composition, cheaply), each under chunked prefill and
    preemption, greedy and sampled: valid JSON; greedy equal to the run
    without drafts; then the engine goes on serving plain requests, with
    the plain tokens."""
    # Fixed k: adaptive drafting would turn drafts that do not pay off.
    specs = [
        SpeculativeConfig(num_speculative_tokens=5, adaptive=False),
        SpeculativeConfig(
            method="draft_model",
            model=str(tiny_draft_path),
            num_speculative_tokens=3,
            adaptive=False,
        ),
    ]
    chat = [{"role": "user", "content": f"Repeat this JSON exactly: {json.dumps(JSON_COPY)}"}]
    any_object = StructuredOutputParams(json_object=True)
    cases = [
        (any_object, 0.0),
        (StructuredOutputParams(json=COPY_SCHEMA), 0.0),
        (any_object, 0.8),
    ]
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for spec in specs:
        # 9 usable blocks of 16 for two requests of ~115 tokens (73 of
        # prompt, 4 blocks of it shared): preemption in the greedy
        # json_object case whatever the sampled case draws; a 32-token
        # budget: the prompts are chunked.
        llm = LLM(
            max_model_len=144,
            num_blocks_override=10,
            max_num_batched_tokens=32,
            speculative=spec,
            exact=True,
        )
        for so, temperature in cases:
            params = SamplingParams(
                max_tokens=60, temperature=temperature, seed=3, structured_outputs=so
            )
            got = llm.chat([chat, chat], params, use_tqdm=False)
            for out in got:
                assert out.finish_reason == "stop", out.text
                json.loads(out.text)
            if temperature == 0.0:
                want = base.chat([chat], params, use_tqdm=False)[0]
                assert got[0].token_ids == want.token_ids
        assert _generate(llm, plain, PROMPTS[:2]) == _generate(base, plain, PROMPTS[:2])
        assert llm.totals.num_preemptions > 0, spec.method
        stats = llm.core.scheduler.spec_stats
        assert stats is not None and stats.num_drafts > 0
        if spec.method == "ngram":
            assert stats.num_accepted_tokens > 0
        llm.core.shutdown()
