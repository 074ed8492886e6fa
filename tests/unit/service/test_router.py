"""The router's legs as messages (pure functions): what each pod is asked."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.kv_cache.hashing import BlockHasher
from engine.request import Request
from engine.sampling_params import SamplingParams
from service.client import make_request
from service.convert import dict_to_struct, struct_to_dict
from service.gen.tandem.v1 import generation_pb2 as pb
from service.pods import PodPool, PodState
from service.router import (
    DEFAULT_MAX_TOKENS,
    RouterServicer,
    _add_counts,
    _decode_request,
    _LegFailed,
    _max_tokens,
    _prefill_request,
    _redact,
)


def test_the_prefill_leg_keeps_its_kv_only_when_a_decode_leg_follows() -> None:
    request = make_request(text="hi", max_tokens=5, stop=["x"], request_id="r")
    leg = _prefill_request(request, [1, 2], 5)
    assert list(leg.token_ids.ids) == [1, 2] and leg.request_id == "r"
    assert leg.sampling.max_tokens == 1 and list(leg.sampling.stop) == ["x"]
    assert struct_to_dict(leg.kv_transfer_params) == {"do_remote_decode": True}
    # One token asked for: the prefill leg is the request, and holds nothing.
    alone = _prefill_request(make_request(text="hi", max_tokens=1), [1, 2], 1)
    assert not alone.HasField("kv_transfer_params")


def test_min_tokens_keep_the_first_token_from_ending_the_request() -> None:
    request = make_request(text="hi", max_tokens=8, min_tokens=3, stop_token_ids=[7])
    leg = _prefill_request(request, [1], 8)
    assert leg.sampling.min_tokens == 1 and leg.sampling.ignore_eos
    assert list(leg.sampling.stop_token_ids) == []
    # min_tokens 1 is met by the first token: EOS there ends the request.
    plain = _prefill_request(make_request(text="hi", min_tokens=1, stop_token_ids=[7]), [1], 16)
    assert not plain.sampling.ignore_eos and list(plain.sampling.stop_token_ids) == [7]


def test_the_decode_leg_says_which_prompt_tokens_are_output() -> None:
    request = make_request(token_ids=[1, 2], max_tokens=5, min_tokens=3, request_id="r")
    request.num_output_tokens_in_prompt = 1  # the client's own continuation
    params = dict_to_struct({"do_remote_prefill": True})
    leg = _decode_request(request, [1, 2], [9], 5, params)
    assert list(leg.token_ids.ids) == [1, 2, 9]
    assert leg.num_output_tokens_in_prompt == 2
    assert (leg.sampling.max_tokens, leg.sampling.min_tokens) == (4, 2)
    assert struct_to_dict(leg.kv_transfer_params) == {"do_remote_prefill": True}


def test_prompt_logprobs_are_asked_of_the_prefill_leg_only() -> None:
    """The decode pod never computes the prompt (and refuses to be asked);
    the prefill leg's first response carries them to the client."""
    request = make_request(token_ids=[1, 2], max_tokens=5, prompt_logprobs=3)
    prefill = _prefill_request(request, [1, 2], 5)
    assert prefill.sampling.prompt_logprobs == 3
    params = dict_to_struct({"do_remote_prefill": True})
    decode = _decode_request(request, [1, 2], [9], 5, params)
    assert not decode.sampling.HasField("prompt_logprobs")
    assert request.sampling.prompt_logprobs == 3  # the client's message is left alone


def test_max_tokens_is_the_whole_requests() -> None:
    assert _max_tokens(pb.GenerateRequest(text="hi")) == DEFAULT_MAX_TOKENS == 16
    assert _max_tokens(make_request(text="hi", max_tokens=3)) == 3
    with pytest.raises(_LegFailed) as info:
        _max_tokens(make_request(text="hi", max_tokens=0))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("sampling.max_tokens: ")
    assert not info.value.maybe_ran
    with pytest.raises(_LegFailed) as info:
        _max_tokens(make_request(text="hi", max_tokens=2, min_tokens=3))
    assert info.value.details == (
        "sampling.min_tokens: must be between 0 and max_tokens (2), got 3"
    )


def test_pod_addresses_never_reach_the_client() -> None:
    grpc_error = (
        "failed to connect to all addresses; last error: UNKNOWN: "
        "ipv4:10.4.2.17:50051: Failed to connect to remote host: Connection refused"
    )
    redacted = _redact(grpc_error, ["10.4.2.17:50051"])
    assert "10.4.2.17" not in redacted and "50051" not in redacted
    assert _redact("peer [fd00::7]:50061 and 192.168.1.9 refused", []) == (
        "peer <address> and <address> refused"
    )
    assert _redact("pod-a.svc:50051 said no", ["pod-a.svc:50051"]) == "<pod> said no"
    # Text without addresses is left alone.
    text = "sampling.temperature: must be >= 0, got -1.0"
    assert _redact(text, ["10.0.0.1:1"]) == text


def test_router_status_sums_the_pods_counts_only() -> None:
    total = pb.ServerStatus()
    for running, hits in ((2, 100), (3, 50)):
        pod = pb.ServerStatus(
            num_running=running,
            prefix_cache_hits=hits,
            kv_cache_usage=0.5,
            uptime_seconds=99.0,
            num_prefill_fallbacks=7,  # a router's field: a pod never counts it
        )
        _add_counts(total, pod)
    assert (total.num_running, total.prefix_cache_hits) == (5, 150)
    assert total.kv_cache_usage == 0.0 and total.uptime_seconds == 0.0
    assert total.num_prefill_fallbacks == 0


def test_router_status_sums_the_pods_spec_decoding_position_by_position() -> None:
    total = pb.ServerStatus()
    _add_counts(total, pb.ServerStatus(num_running=1))  # a pod that does not speculate
    assert not total.HasField("spec_decoding")
    for drafts, per_pos in ((4, [3, 1]), (2, [2, 2, 1])):  # pods speculating 2 and 3 deep
        pod = pb.ServerStatus()
        pod.spec_decoding.num_drafts = drafts
        pod.spec_decoding.num_draft_tokens = 3 * drafts
        pod.spec_decoding.num_accepted_tokens = sum(per_pos)
        pod.spec_decoding.num_accepted_tokens_per_pos.extend(per_pos)
        _add_counts(total, pod)
    spec = total.spec_decoding
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (6, 18, 9)
    assert list(spec.num_accepted_tokens_per_pos) == [5, 3, 1]
    assert total.num_running == 1


def test_the_router_finds_a_prompt_where_the_pods_engines_hashed_it() -> None:
    """Prefix-aware routing matches the router's hashes of a prompt against
    the block hashes a pod's KV events name, which its engine's BlockHasher
    computed: the two must be the same chain (the same function)."""
    ids = list(range(100, 111))  # two full blocks of 4, and a partial one
    engine_side = Request("r", ids, SamplingParams(), block_hasher=BlockHasher(4)).block_hashes

    async def route() -> tuple[list[bytes], int]:
        pool = PodPool(
            "decode", ["127.0.0.1:9", "127.0.0.1:10"], follow_kv_events=True, poll_seconds=60.0
        )
        holder = pool.pods[1]
        for pod in pool.pods:
            pod.block_size, pod.state = 4, PodState.UP
        holder.load = 5.0  # busier, but it holds the prompt's blocks
        holder.blocks.update(engine_side)
        try:
            hashes = RouterServicer(None, pool)._hashes(pool, ids)
            picked = pool.pick(hashes)
            assert picked is not None
            return hashes, pool.pods.index(picked)
        finally:
            await pool.close()

    hashes, picked = asyncio.run(route())
    assert len(engine_side) == 2 and hashes == engine_side
    assert picked == 1
