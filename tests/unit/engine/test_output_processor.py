"""OutputProcessor at a prefill/decode handover, with the real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from engine.kv_transfer.params import KVTransferParams
from engine.models.loader import load_tokenizer, resolve_model
from engine.output_processor import OutputKind, OutputProcessor, RequestOutput
from engine.outputs import EngineCoreOutput, LogprobsLists, PromptLogprobs
from engine.request import FinishReason, Request
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams

EMOJI = "\U0001f389"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(resolve_model(None))


def _one_token(
    tokenizer: PreTrainedTokenizerBase,
    token_id: int,
    reason: FinishReason,
    params: dict[str, Any] | None,
    stop: list[str] | None = None,
) -> RequestOutput:
    """A one-token request's only output."""
    processor = OutputProcessor(tokenizer)
    sampling = SamplingParams(max_tokens=1, stop=stop or [])
    kv_params = KVTransferParams.from_dict(params) if params is not None else None
    options = RequestOptions(kv_transfer_params=kv_params)
    processor.add_request(Request("r", [1, 2, 3], sampling, options=options), None)
    return processor.process([EngineCoreOutput("r", [token_id], reason)]).outputs[0]


def test_a_prefill_leg_that_hands_over_keeps_back_an_incomplete_character(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    first = tokenizer.encode(EMOJI)[0]  # the emoji's first byte
    remote = {"do_remote_decode": True}
    handed_over = _one_token(tokenizer, first, FinishReason.LENGTH, remote)
    assert handed_over.finished and handed_over.text == ""
    # The output ends here: flushed, as a full decode would show it.
    assert _one_token(tokenizer, first, FinishReason.LENGTH, None).text == "\ufffd"
    assert _one_token(tokenizer, first, FinishReason.STOP, remote).text == "\ufffd"


def test_a_prefill_leg_that_hands_over_keeps_back_a_stop_string_start(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    (four,) = tokenizer.encode(" four")
    out = _one_token(tokenizer, four, FinishReason.LENGTH, {"do_remote_decode": True}, ["ur,"])
    assert out.text == " fo" and out.finish_reason == "length"
    assert _one_token(tokenizer, four, FinishReason.LENGTH, None, ["ur,"]).text == " four"


def test_a_resumed_request_streams_the_rest_of_the_text(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = tokenizer.encode(EMOJI)
    processor = OutputProcessor(tokenizer)
    options = RequestOptions(num_output_tokens_in_prompt=1)
    request = Request("r", [1, 2, ids[0]], SamplingParams(), options=options)
    processor.add_request(request, None)
    (out,) = processor.process([EngineCoreOutput("r", ids[1:], FinishReason.LENGTH)]).outputs
    assert out.text == EMOJI and out.token_ids == ids[1:]


def test_logprobs_carry_each_tokens_text(tokenizer: PreTrainedTokenizerBase) -> None:
    hello, world = tokenizer.encode("Hello world")
    processor = OutputProcessor(tokenizer)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1))
    processor.add_request(request, None, OutputKind.FINAL)
    rows = LogprobsLists([[hello, world]], [[-0.5, -1.5]], [1])
    assert processor.process([EngineCoreOutput("r", [hello], new_logprobs=rows)]).outputs == []
    rows = LogprobsLists([[world, hello]], [[-0.1, -3.0]], [1])
    (out,) = processor.process(
        [EngineCoreOutput("r", [world], FinishReason.LENGTH, new_logprobs=rows)]
    ).outputs
    assert out.logprobs is not None and [lp.token_id for lp in out.logprobs] == [hello, world]
    assert out.logprobs[0].text == {hello: "Hello", world: " world"}
    assert out.logprobs[0].top == {world: -1.5}
    assert out.text == "Hello world" and out.token_ids == [hello, world]


def test_an_output_without_logprobs_asked_has_none(tokenizer: PreTrainedTokenizerBase) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(Request("r", [1, 2, 3], SamplingParams()), "a prompt")
    (out,) = processor.process([EngineCoreOutput("r", [5])]).outputs
    assert out.logprobs is None and out.prompt == "a prompt" and not out.finished


def _prompt_chunk(
    first_token: int, rows: list[tuple[int, float, int, int, float]]
) -> PromptLogprobs:
    """Rows of (prompt token, its logprob, its rank, top-1 token, its logprob)."""
    return PromptLogprobs(
        first_token,
        LogprobsLists(
            [[t, top] for t, _, _, top, _ in rows],
            [[lp, top_lp] for _, lp, _, _, top_lp in rows],
            [rank for _, _, rank, _, _ in rows],
        ),
    )


def test_prompt_logprobs_put_together_come_with_the_first_output_only(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    hello, world, bang = tokenizer.encode("Hello world!")
    processor = OutputProcessor(tokenizer)
    request = Request("r", [hello, world, bang], SamplingParams(max_tokens=3, prompt_logprobs=1))
    processor.add_request(request, None)
    first = _prompt_chunk(1, [(world, -2.0, 3, bang, -0.5)])
    # A prefill chunk alone sends nothing.
    mid = processor.process([EngineCoreOutput("r", [], new_prompt_logprobs=first)])
    assert mid.outputs == [] and mid.num_later_tokens == 0
    second = _prompt_chunk(2, [(bang, -0.25, 1, bang, -0.25)])
    (out,) = processor.process([EngineCoreOutput("r", [7], new_prompt_logprobs=second)]).outputs
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    world_lp, bang_lp = out.prompt_logprobs[1:]
    assert world_lp is not None and bang_lp is not None
    assert (world_lp.token_id, world_lp.logprob, world_lp.rank) == (world, -2.0, 3)
    assert world_lp.top == {bang: -0.5} and world_lp.text == {world: " world", bang: "!"}
    assert (bang_lp.token_id, bang_lp.rank, bang_lp.top) == (bang, 1, {bang: -0.25})
    (later,) = processor.process([EngineCoreOutput("r", [8])]).outputs
    assert later.prompt_logprobs is None


def test_prompt_logprobs_computed_again_take_the_same_places(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """A prompt recomputed after preemption gives its rows again; with no
    top asked for (0), only the prompt token's own entry is kept."""
    processor = OutputProcessor(tokenizer)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=0))
    processor.add_request(request, None, OutputKind.FINAL)
    rows = [(2, -1.0, 2, 9, -0.1), (3, -2.0, 4, 9, -0.2)]
    for chunk in (_prompt_chunk(1, rows[:1]), _prompt_chunk(1, rows)):
        processor.process([EngineCoreOutput("r", [], new_prompt_logprobs=chunk)])
    (out,) = processor.process([EngineCoreOutput("r", [5], FinishReason.LENGTH)]).outputs
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 3
    assert [lp.token_id if lp else None for lp in out.prompt_logprobs] == [None, 2, 3]
    assert all(lp is None or lp.top == {} for lp in out.prompt_logprobs)


def test_an_abort_mid_prefill_sends_the_prompt_logprobs_computed_so_far(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    processor = OutputProcessor(tokenizer)
    request = Request("r", [1, 2, 3, 4], SamplingParams(prompt_logprobs=0))
    processor.add_request(request, None)
    processor.process(
        [EngineCoreOutput("r", [], new_prompt_logprobs=_prompt_chunk(1, [(2, -1.0, 1, 2, -1.0)]))]
    )
    out = processor.abort("r", FinishReason.ABORT)
    assert out is not None and out.prompt_logprobs is not None
    assert [lp.token_id if lp else None for lp in out.prompt_logprobs] == [None, 2, None, None]
