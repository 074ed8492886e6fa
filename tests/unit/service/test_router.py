"""The router's legs as messages (pure functions): what each pod is asked."""

from __future__ import annotations

import asyncio
from typing import cast

import grpc
import pytest

from engine.kv_cache.hashing import BlockHasher
from engine.lora.request import LoRARequest
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


# --- LoRA adapters -------------------------------------------------------------------


def _adapter(name: str, key: str = "") -> pb.LoraAdapter:
    return pb.LoraAdapter(lora_name=name, cache_key=key or f"lora:{name}")


def _up_pool(name: str, loras: list[list[str]]) -> PodPool:
    """Healthy pods (not started: nothing is polled), with these adapters each."""
    addresses = [f"127.0.0.1:{9 + i}" for i in range(len(loras))]
    pool = PodPool(name, addresses, follow_kv_events=name == "decode", poll_seconds=60.0)
    for pod, names in zip(pool.pods, loras, strict=True):
        pod.state, pod.block_size = PodState.UP, 4
        pod.loras = {n: _adapter(n) for n in names}
    return pool


def test_adapter_requests_go_only_to_pods_that_have_it() -> None:
    async def go() -> None:
        decode = _up_pool("decode", [["a"], []])
        decode.pods[0].load = 9.0  # busier, but the only one with "a"
        try:
            assert decode.pick(lora="a") is decode.pods[0]
            assert decode.pick(lora="b") is None
            assert decode.pick() is decode.pods[1]
            router = RouterServicer(None, decode)
            router._check_lora("")
            router._check_lora("a")
            with pytest.raises(_LegFailed) as info:
                router._check_lora("b")
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details == "lora_name: unknown LoRA adapter 'b': loaded are ['a']"
        finally:
            await decode.close()

    asyncio.run(go())


def test_with_a_prefill_pool_both_legs_need_the_adapter() -> None:
    async def go() -> None:
        prefill = _up_pool("prefill", [["a", "c"]])
        decode = _up_pool("decode", [["a", "b"]])
        try:
            router = RouterServicer(prefill, decode)
            router._check_lora("a")
            for name in ("b", "c"):
                with pytest.raises(_LegFailed, match=r"loaded are \['a'\]"):
                    router._check_lora(name)
            # No prefill pod healthy: the request falls back whole to a decode pod.
            prefill.pods[0].state = PodState.DOWN
            router._check_lora("b")
        finally:
            await prefill.close()
            await decode.close()

    asyncio.run(go())


def test_the_router_hashes_an_adapters_prompt_as_the_pods_engines_do() -> None:
    ids = list(range(100, 109))  # two full blocks of 4
    adapter = LoRARequest("a", 1, "/a", "lora:a", rank=8)
    hasher = BlockHasher(4)
    engine_side = Request("r", ids, SamplingParams(), block_hasher=hasher, lora_request=adapter)
    base = Request("s", ids, SamplingParams(), block_hasher=hasher).block_hashes

    async def go() -> list[bytes]:
        decode = _up_pool("decode", [["a"]])
        try:
            return RouterServicer(None, decode)._hashes(decode, ids, "a")
        finally:
            await decode.close()

    hashes = asyncio.run(go())
    assert len(hashes) == 2 and hashes == engine_side.block_hashes != base


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """Stands in for grpc.aio.ServicerContext: abort raises."""

    async def abort(self, code: grpc.StatusCode, details: str, *_: object) -> None:
        raise _Aborted(code, details)


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _LoraPodStub:
    """A pod's LoRA RPCs over a dict, as the servicer answers them."""

    def __init__(self, names: list[str], enabled: bool = True) -> None:
        self.loras = {n: _adapter(n) for n in names}
        self.enabled = enabled

    def _check(self) -> None:
        if not self.enabled:
            raise _rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "start it with --enable-lora")

    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, **_: object
    ) -> pb.LoraAdapter:
        self._check()
        if request.lora_name in self.loras:
            raise _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: already loaded")
        self.loras[request.lora_name] = _adapter(request.lora_name)
        return self.loras[request.lora_name]

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, **_: object
    ) -> pb.UnloadLoraAdapterResponse:
        self._check()
        if request.lora_name not in self.loras:
            raise _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: unknown")
        return pb.UnloadLoraAdapterResponse(adapter=self.loras.pop(request.lora_name))

    async def ListLoraAdapters(self, request: object, **_: object) -> pb.ListLoraAdaptersResponse:
        return pb.ListLoraAdaptersResponse(adapters=list(self.loras.values()))


def _lora_router(stubs: list[_LoraPodStub]) -> tuple[RouterServicer, PodPool]:
    pool = _up_pool("decode", [list(s.loras) for s in stubs])
    for pod, stub in zip(pool.pods, stubs, strict=True):
        pod.stub = stub  # type: ignore[assignment]
    return RouterServicer(None, pool), pool


def test_load_reaches_every_pod_and_unload_those_that_have_it() -> None:
    stubs = [_LoraPodStub(["x"]), _LoraPodStub([])]
    context = cast(grpc.aio.ServicerContext, _Context())

    async def go() -> list[str]:
        router, pool = _lora_router(stubs)
        try:
            load = pb.LoadLoraAdapterRequest(lora_name="a", lora_path="/a")
            assert (await router.LoadLoraAdapter(load, context)).lora_name == "a"
            # Known at once, not only after the next poll.
            assert all("a" in pod.loras for pod in pool.pods)
            listed = await router.ListLoraAdapters(pb.ListLoraAdaptersRequest(), context)
            unload = pb.UnloadLoraAdapterRequest(lora_name="x")  # on the first pod only
            assert (await router.UnloadLoraAdapter(unload, context)).adapter.lora_name == "x"
            assert "x" not in pool.pods[0].loras
            with pytest.raises(_Aborted) as info:
                await router.UnloadLoraAdapter(unload, context)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details == "lora_name: unknown LoRA adapter 'x': loaded are ['a']"
            return [a.lora_name for a in listed.adapters]
        finally:
            await pool.close()

    assert asyncio.run(go()) == ["a", "x"]  # one entry per adapter, however many pods
    assert [list(s.loras) for s in stubs] == [["a"], ["a"]]


def test_a_load_one_pod_refuses_is_undone_on_the_others() -> None:
    stubs = [_LoraPodStub([]), _LoraPodStub([], enabled=False)]
    context = cast(grpc.aio.ServicerContext, _Context())

    async def go() -> _Aborted:
        router, pool = _lora_router(stubs)
        try:
            with pytest.raises(_Aborted) as info:
                await router.LoadLoraAdapter(
                    pb.LoadLoraAdapterRequest(lora_name="a", lora_path="/a"), context
                )
            assert not any(pod.loras for pod in pool.pods)
            return info.value
        finally:
            await pool.close()

    refused = asyncio.run(go())
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.details == "decode pod: start it with --enable-lora"
    assert stubs[0].loras == {}  # loaded there, then unloaded again


# --- weight formats -------------------------------------------------------------------


class _FormatPodStub:
    """A pod's model info and status, with this weight format."""

    def __init__(self, weight_format: str) -> None:
        self.weight_format = weight_format

    async def GetModelInfo(self, request: object, **_: object) -> pb.ModelInfo:
        return pb.ModelInfo(model_name="m", role="both", weight_format=self.weight_format)

    async def GetServerStatus(self, request: object, **_: object) -> pb.ServerStatus:
        return pb.ServerStatus(num_running=1, weight_format=self.weight_format)


def _format_pool(name: str, formats: list[str]) -> PodPool:
    pool = _up_pool(name, [[] for _ in formats])
    for pod, weight_format in zip(pool.pods, formats, strict=True):
        pod.stub = _FormatPodStub(weight_format)  # type: ignore[assignment]
        pod.weight_format = weight_format  # as its last poll said
    return pool


def test_the_router_reports_its_pods_weight_format() -> None:
    context = cast(grpc.aio.ServicerContext, _Context())

    async def ask(prefill: list[str], decode: list[str]) -> tuple[str, str, int]:
        pools = _format_pool("prefill", prefill), _format_pool("decode", decode)
        try:
            router = RouterServicer(*pools)
            info = await router.GetModelInfo(pb.GetModelInfoRequest(), context)
            status = await router.GetServerStatus(pb.GetServerStatusRequest(), context)
            return info.weight_format, status.weight_format, status.num_running
        finally:
            for pool in pools:
                await pool.close()

    # Pods that agree: their format, as a pod would report it.
    same = asyncio.run(ask(["q4_1+q8_0"], ["q4_1+q8_0", "q4_1+q8_0"]))
    assert same == ("q4_1+q8_0", "q4_1+q8_0", 3)
    # Pods that differ: the distinct formats, joined with ",".
    mixed = asyncio.run(ask(["float32"], ["q4_1+q8_0", "int8+float32"]))
    assert mixed[:2] == ("float32,int8+float32,q4_1+q8_0",) * 2
