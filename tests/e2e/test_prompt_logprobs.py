"""Prompt logprobs through the LLM API on the default model, against
transformers' own forward over the prompt: a prompt split into several
prefill chunks, beside a request that asks for none, and after the same
prompt was cached. On the exact path (float activations, float32 cache)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams

ATOL = 1e-3  # float32 on both sides
TOP = 4
CHUNK = 16  # tokens of a prompt per step (long_prefill_token_threshold)
TEXT = (
    "The history of bread begins in the Neolithic, when people first ground wild grains "
    "between stones, mixed the flour with water and baked the paste on hot rocks. Leavened "
    "bread came later, perhaps by accident, when a dough left out in the warmth caught wild "
    "yeasts from the air and rose before it was baked. By Roman times bakeries were a "
    "trade of their own, with mills turned by donkeys and ovens that fed a whole street."
)
OTHER = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def llm() -> LLM:
    # A small budget and chunk: the prompt takes several steps, in
    # batches shared with the other request.
    return LLM(
        max_model_len=512,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=CHUNK,
        exact=True,
    )


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    ids: list[int] = tokenizer.encode(TEXT)
    assert len(ids) > 4 * CHUNK
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompt) -> torch.Tensor:
    """log_softmax of transformers' logits: row p scores prompt token p + 1."""
    with torch.inference_mode():
        logits: torch.Tensor = hf_model(input_ids=torch.tensor([prompt])).logits[0, :-1]
    return logits.float().log_softmax(dim=-1)


def _params(**kw: object) -> SamplingParams:
    values: dict[str, object] = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    return SamplingParams(**(values | kw))  # type: ignore[arg-type]


def _check_against(reference: torch.Tensor, prompt: list[int], out: RequestOutput) -> None:
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None  # the first token has no context
    for pos, entry in enumerate(entries[1:]):
        assert entry is not None
        row = reference[pos]
        token = prompt[pos + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=ATOL)
        want_values, want_ids = row.topk(TOP + 1)
        assert list(entry.top.values()) == pytest.approx(want_values[:TOP].tolist(), abs=ATOL)
        gaps = want_values[:-1] - want_values[1:]
        if bool((gaps > 2 * ATOL).all()):  # no near-tie that float error may reorder
            assert list(entry.top) == want_ids[:TOP].tolist()
        if not bool(((row - row[token]).abs() < 2 * ATOL).sum() > 1):
            assert entry.rank == 1 + int((row > row[token]).sum())


def test_prompt_logprobs_over_several_chunks_match_transformers(llm, prompt, reference):
    alone = llm.generate(OTHER, _params(), use_tqdm=False)[0]
    want = _params(prompt_logprobs=TOP)
    outs = llm.generate([OTHER, prompt, OTHER], [_params(), want, _params()], use_tqdm=False)
    _check_against(reference, prompt, outs[1])
    # The requests beside it are as they are alone.
    for other in (outs[0], outs[2]):
        assert other.prompt_logprobs is None
        assert (other.token_ids, other.text) == (alone.token_ids, alone.text)
    # Its own output is the greedy one.
    plain = llm.generate(prompt, _params(), use_tqdm=False)[0]
    assert outs[1].token_ids == plain.token_ids


def test_a_cached_prompt_is_computed_again_for_its_logprobs(llm, prompt, reference):
    first = llm.generate(prompt, _params(), use_tqdm=False)[0]
    cached = llm.generate(prompt, _params(), use_tqdm=False)[0]
    assert cached.num_cached_tokens >= 4 * CHUNK  # the prompt is in the prefix cache
    out = llm.generate(prompt, _params(prompt_logprobs=TOP), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    _check_against(reference, prompt, out)
    assert out.token_ids == first.token_ids


def test_zero_keeps_the_prompt_tokens_own_logprob_only(llm, prompt, reference):
    out = llm.generate(prompt[:20], _params(prompt_logprobs=0, max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 20
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        assert entry is not None and entry.top == {}
        assert entry.logprob == pytest.approx(reference[pos, prompt[pos + 1]].item(), abs=ATOL)
