"""The VllmEngine conversions: sampling as vLLM's servicer reads it, and KV
events in the protocol's shape."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from engine.kv_events import KvEventBatch
from engine.kv_transfer.params import KVTransferParams
from service import vllm_convert as convert


def test_zero_means_unset_where_the_field_has_no_presence() -> None:
    params = convert.sampling_params(vpb.SamplingParams())
    assert params == SamplingParams()  # every default, as vLLM's servicer reads it
    assert params.top_p == 1.0 and params.temperature == 1.0 and params.top_k == 0


def test_fields_with_presence_are_taken_even_when_zero() -> None:
    params = convert.sampling_params(
        vpb.SamplingParams(temperature=0.0, max_tokens=5, seed=0, logprobs=0)
    )
    assert params.temperature == 0.0 and params.greedy
    assert params.max_tokens == 5 and params.seed == 0 and params.logprobs == 0


def test_the_rest_carry_over() -> None:
    params = convert.sampling_params(
        vpb.SamplingParams(
            top_p=0.5, top_k=7, min_tokens=2, stop=["x"], stop_token_ids=[3], ignore_eos=True
        )
    )
    assert (params.top_p, params.top_k, params.min_tokens) == (0.5, 7, 2)
    assert params.stop == ["x"] and params.stop_token_ids == [3] and params.ignore_eos


def test_a_bad_value_names_the_proto_field() -> None:
    with pytest.raises(InvalidRequestError, match=r"^sampling_params\.max_tokens: "):
        convert.sampling_params(vpb.SamplingParams(max_tokens=0))


def test_fold_hash_is_the_last_eight_bytes_big_endian_as_int64() -> None:
    digest = hashlib.sha256(b"block").digest()
    unsigned = int.from_bytes(digest[-8:], "big")
    folded = convert.fold_hash(digest)
    assert folded % (1 << 64) == unsigned
    assert -(1 << 63) <= folded < 1 << 63
    assert convert.fold_hash(b"\x00" * 24 + b"\xff" * 8) == -1


def test_kv_events_become_the_protocols_batches() -> None:
    h1, h2, parent = (hashlib.sha256(bytes([i])).digest() for i in range(3))
    batch = KvEventBatch(
        sequence=4,
        timestamp=12.5,
        events=[
            BlockStored([h1, h2], parent, list(range(32)), 16),
            BlockRemoved([h1]),
            AllBlocksCleared(),
        ],
    )
    out = convert.kv_event_batch(batch, first_event_id=10)
    assert out.sequence_number == 4 and out.timestamp == 12.5
    stored, removed, cleared = out.events
    assert [e.event_id for e in out.events] == [10, 11, 12]
    assert [b.block_hash for b in stored.stored.blocks] == [
        convert.fold_hash(h1),
        convert.fold_hash(h2),
    ]
    assert [list(b.token_ids) for b in stored.stored.blocks] == [
        list(range(16)),
        list(range(16, 32)),
    ]
    assert stored.stored.parent_block_hash == convert.fold_hash(parent)
    assert stored.stored.medium == "GPU"
    assert list(removed.removed.block_hashes) == [convert.fold_hash(h1)]
    assert cleared.WhichOneof("data") == "cleared"


def test_each_models_worker_sees_only_the_blocks_stored_under_its_model() -> None:
    """The base model's port and each adapter's port (--lora-port): stored
    blocks go to their own model's subscribers; removals and clears, which
    name no model, to all."""
    h1, h2 = (hashlib.sha256(bytes([i])).digest() for i in range(2))
    base = BlockStored([h1], None, list(range(16)), 16)
    adapted = BlockStored([h2], None, list(range(16)), 16, lora_id=1, lora_name="qv8")
    batch = KvEventBatch(3, 1.0, [base, adapted, BlockRemoved([h1]), AllBlocksCleared()])
    assert convert.events_of_model(batch, None).events == [base, *batch.events[2:]]
    assert convert.events_of_model(batch, "qv8").events == [adapted, *batch.events[2:]]
    assert convert.events_of_model(batch, "other").events == batch.events[2:]
    assert convert.events_of_model(batch, "qv8").sequence == 3


def test_a_sequence_start_has_no_parent() -> None:
    batch = KvEventBatch(1, 0.0, [BlockStored([b"\x01" * 32], None, [0] * 16, 16)])
    (event,) = convert.kv_event_batch(batch, 1).events
    assert not event.stored.HasField("parent_block_hash")


def _output(**kwargs: Any) -> RequestOutput:
    values: dict[str, Any] = {
        "request_id": "r",
        "prompt": None,
        "prompt_token_ids": [5, 6, 7],
        "text": "",
        "token_ids": [9],
        "logprobs": None,
        "finish_reason": FinishReason.LENGTH,
        "stop_reason": None,
        "num_generated_tokens": 1,
        "num_cached_tokens": 0,
    }
    return RequestOutput(**{**values, **kwargs})


def test_prompt_logprobs_go_out_as_input_logprobs_with_no_value_first() -> None:
    prompt = [
        None,
        TokenLogprob(6, -1.5, 2, {8: -0.5, 6: -1.5}),
        TokenLogprob(7, -0.25, 1, {7: -0.25, 3: -2.0}),
    ]
    choice = convert.ChoiceOutput.merge(0, [_output(prompt_logprobs=prompt)])
    (streamed,) = [convert.chunk(choice, None).chunk.input_logprobs]
    done = convert.complete(choice, None).complete.input_logprobs
    for got in (streamed, done):
        assert list(got.token_ids) == [5, 6, 7]
        assert [e.HasField("value") for e in got.token_logprobs] == [False, True, True]
        assert [e.value for e in got.token_logprobs[1:]] == [-1.5, -0.25]
        assert list(got.top_logprobs[1].token_ids) == [8, 6]
        assert list(got.top_logprobs[2].values) == [-0.25, -2.0]


def test_no_input_logprobs_unless_asked() -> None:
    choice = convert.ChoiceOutput.merge(0, [_output()])
    assert not convert.chunk(choice, None).chunk.HasField("input_logprobs")


def test_a_finished_output_carries_the_matched_stop_and_kv_params_as_json() -> None:
    params = KVTransferParams(do_remote_prefill=True, num_blocks=3)
    out = _output(finish_reason=FinishReason.STOP, stop_reason="END", kv_transfer_params=params)
    done = convert.complete(convert.ChoiceOutput.merge(0, [out]), None).complete
    assert done.finish_reason == "stop" and done.matched_stop_str == "END"
    assert json.loads(done.kv_transfer_params_json) == {"do_remote_prefill": True, "num_blocks": 3}
    token_stop = _output(finish_reason=FinishReason.STOP, stop_reason=2)
    by_token = convert.complete(convert.ChoiceOutput.merge(0, [token_stop]), None).complete
    assert by_token.matched_token_id == 2


def test_vllms_extras_carry_over() -> None:
    params = convert.sampling_params(
        vpb.SamplingParams(
            min_p=0.1,
            frequency_penalty=0.5,
            presence_penalty=-0.25,
            repetition_penalty=1.2,
            logit_bias={5: 2.0},
            prompt_logprobs=3,
        )
    )
    assert (params.min_p, params.frequency_penalty, params.presence_penalty) == pytest.approx(
        (0.1, 0.5, -0.25)
    )
    assert params.repetition_penalty == pytest.approx(1.2)
    assert params.logit_bias == {5: 2.0} and params.prompt_logprobs == 3


def test_a_bad_extra_names_its_proto_field() -> None:
    with pytest.raises(InvalidRequestError, match=r"^sampling_params\.presence_penalty: "):
        convert.sampling_params(vpb.SamplingParams(presence_penalty=3.0))


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "want"),
    [
        ("float32", "float32", "auto"),
        ("bfloat16", "float32", "bfloat16"),
        ("bfloat16", "bfloat16", "auto"),
    ],
)
def test_the_kv_cache_dtype_is_spelled_as_vllms_flag(
    cache_dtype: str, dtype: str, want: str
) -> None:
    """The resolved cache (bfloat16 on Tandem's fast default) as vLLM's
    --kv-cache-dtype says it: "auto" is the model's dtype."""
    assert convert.vllm_kv_cache_dtype(cache_dtype, dtype) == want
