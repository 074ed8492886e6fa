"""RequestOptions: both converters build one, and the Request holds it as
built; cache_salt keys the prefix cache from the wire to the scheduler."""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine import InputProcessor, RequestOptions
from engine.kv_transfer.params import KVTransferParams
from engine.models.loader import load_tokenizer, resolve_model
from engine.sched.scheduler import Scheduler
from service import convert, vllm_convert
from service.client import make_request
from tests.unit.engine.sched.harness import make_scheduler, run_to_completion, step

PROMPT = list(range(100, 117))  # two full blocks of 8, and one token


@pytest.fixture(scope="module")
def inputs() -> InputProcessor:
    tok = load_tokenizer(resolve_model(None))
    return InputProcessor(tok, vocab_size=49152, max_model_len=64, eos_token_id=2)


def test_the_tandem_converter_builds_the_options_the_request_holds(
    inputs: InputProcessor,
) -> None:
    msg = make_request(token_ids=PROMPT, priority=3, cache_salt="tenant-a")
    msg.kv_transfer_params.update({"do_remote_decode": True})
    msg.num_output_tokens_in_prompt = 1
    call = convert.generate_input(msg, inputs)
    assert call.options == RequestOptions(
        priority=3,
        kv_transfer_params=KVTransferParams(do_remote_decode=True),
        cache_salt="tenant-a",
        num_output_tokens_in_prompt=1,
    )
    request = inputs.make_request("r", call.prompt, call.params, call.options)
    assert request.options is call.options
    assert (request.priority, request.cache_salt, request.num_output_tokens_in_prompt) == (
        3,
        "tenant-a",
        1,
    )
    # Empty strings are the wire's "unset".
    plain = convert.generate_input(make_request(token_ids=PROMPT), inputs).options
    assert plain == RequestOptions()


def test_the_vllm_converter_carries_the_kv_transfer_params(inputs: InputProcessor) -> None:
    msg = vpb.GenerateRequest(request_id="v", tokenized=vpb.TokenizedInput(input_ids=PROMPT))
    msg.kv_transfer_params_json = '{"do_remote_prefill": true, "num_blocks": 2}'
    call = vllm_convert.generate_input(msg, inputs, role="both").call
    want = KVTransferParams(do_remote_prefill=True, num_blocks=2)
    assert call.options == RequestOptions(kv_transfer_params=want)


def _cached_tokens(sched: Scheduler, inputs: InputProcessor, rid: str, salt: str) -> int:
    call = convert.generate_input(make_request(token_ids=PROMPT, cache_salt=salt), inputs)
    sched.add_request(inputs.make_request(rid, call.prompt, call.params, call.options))
    step(sched)
    cached = sched.requests[rid].num_cached_tokens
    run_to_completion(sched)
    return cached


def test_requests_share_prefix_cache_blocks_only_under_the_same_salt(
    inputs: InputProcessor,
) -> None:
    sched = make_scheduler(block_size=8)
    assert _cached_tokens(sched, inputs, "r1", "tenant-a") == 0
    assert _cached_tokens(sched, inputs, "r2", "tenant-a") == 16  # both full blocks
    assert _cached_tokens(sched, inputs, "r3", "tenant-b") == 0
    assert _cached_tokens(sched, inputs, "r4", "") == 0  # the unsalted cache
    assert _cached_tokens(sched, inputs, "r5", "") == 16
    assert _cached_tokens(sched, inputs, "r6", "tenant-b") == 16
