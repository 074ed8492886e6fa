"""The router's legs as messages (pure functions): what each pod is asked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import cast

import grpc
import pytest

from engine.kv_cache.hashing import BlockHasher
from engine.lora.request import LoRARequest
from engine.request import Request
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams
from service.client import make_request
from service.convert import dict_to_struct, struct_to_dict
from service.errors import refused_metadata
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
            router = RouterServicer(None, decode)
            adapter = router._check_lora("a")
            assert adapter is not None
            return router._hashes(decode, ids, adapter.hash_key())
        finally:
            await decode.close()

    hashes = asyncio.run(go())
    assert len(hashes) == 2 and hashes == engine_side.block_hashes != base


def test_the_router_hashes_a_salted_prompt_as_the_pods_engines_do() -> None:
    ids = list(range(100, 109))  # two full blocks of 4
    salted = Request(
        "r",
        ids,
        SamplingParams(),
        options=RequestOptions(cache_salt="t"),
        block_hasher=BlockHasher(4),
    ).block_hashes

    async def go() -> tuple[list[bytes], list[bytes]]:
        decode = _up_pool("decode", [[]])
        try:
            router = RouterServicer(None, decode)
            return router._hashes(decode, ids, None, "t"), router._hashes(decode, ids)
        finally:
            await decode.close()

    hashes, plain = asyncio.run(go())
    assert len(hashes) == 2 and hashes == salted != plain


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """Stands in for grpc.aio.ServicerContext: abort raises (and keeps the
    trailing metadata it was given)."""

    metadata: tuple[tuple[str, str], ...] = ()

    async def abort(
        self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.metadata = metadata
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


# --- Generate over scripted pods: leg ids, aborts, adapters' files, usage -------------

Script = Callable[[pb.GenerateRequest], list[pb.GenerateResponse]]


class _Stream:
    """A pod's Generate call: the scripted responses, and after `hold`
    responses it waits for `release` (a request still running)."""

    def __init__(
        self, responses: list[pb.GenerateResponse], hold: int | None, release: asyncio.Event
    ) -> None:
        self.responses, self.hold, self.release = responses, hold, release

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[pb.GenerateResponse]:
        for i, resp in enumerate(self.responses):
            if i == self.hold:
                await self.release.wait()
            yield resp

    def cancel(self) -> None:
        pass


class _GenPodStub:
    """A pod's Generate (as `script` answers each request) and Abort."""

    def __init__(self, script: Script, hold: int | None = None) -> None:
        self.script, self.hold = script, hold
        self.release = asyncio.Event()
        self.requests: list[pb.GenerateRequest] = []
        self.aborts: list[list[str]] = []

    def Generate(self, request: pb.GenerateRequest, **_: object) -> _Stream:
        self.requests.append(request)
        return _Stream(self.script(request), self.hold, self.release)

    async def Abort(self, request: pb.AbortRequest, **_: object) -> pb.AbortResponse:
        self.aborts.append(list(request.request_ids))
        self.release.set()  # the aborted request ends now
        return pb.AbortResponse(aborted_request_ids=list(request.request_ids))


def _answer(
    tokens: list[int], finish: int, cached: int = 0, handover: bool = False
) -> list[pb.GenerateResponse]:
    """One response per token, the last with `finish` and usage."""
    out = [pb.GenerateResponse(token_ids=[t]) for t in tokens] or [pb.GenerateResponse()]
    last = out[-1]
    last.finish_reason = finish  # type: ignore[assignment]
    last.usage.completion_tokens, last.usage.cached_tokens = len(tokens), cached
    if handover:
        last.kv_transfer_params.CopyFrom(dict_to_struct({"do_remote_prefill": True}))
    return out


def _scripted(name: str, stubs: list[_GenPodStub], loras: list[dict[str, str]]) -> PodPool:
    """Healthy pods answering as `stubs`; each with adapters {name: cache_key}."""
    pool = _up_pool(name, [[] for _ in stubs])
    for pod, stub, adapters in zip(pool.pods, stubs, loras, strict=True):
        pod.stub = stub  # type: ignore[assignment]
        pod.loras = {n: _adapter(n, key) for n, key in adapters.items()}
    return pool


async def _drain(
    call: AsyncIterator[pb.GenerateResponse],
) -> tuple[list[pb.GenerateResponse], _Aborted | None]:
    got: list[pb.GenerateResponse] = []
    try:
        async for resp in call:
            got.append(resp)
    except _Aborted as e:
        return got, e
    return got, None


def _ids_request(rid: str, max_tokens: int = 4, lora: str = "") -> pb.GenerateRequest:
    return make_request(
        token_ids=list(range(10, 19)), max_tokens=max_tokens, request_id=rid, lora_name=lora
    )


def test_legs_go_under_their_own_ids_and_a_reused_id_reaches_no_pod() -> None:
    """The pods see leg ids, never the client's; the client sees its own.
    A second call under a live call's id is refused (marked refused) and
    sends nothing; Abort of the client's id reaches the live leg by its leg
    id, and the leg's ABORT is then the call's answer."""
    pod = _GenPodStub(lambda r: _answer([7, 8, 9], pb.FINISH_REASON_LENGTH), hold=1)

    async def go() -> tuple[object, ...]:
        decode = _scripted("decode", [pod], [{}])
        context = _Context()
        ctx = cast(grpc.aio.ServicerContext, context)
        try:
            router = RouterServicer(None, decode)
            victim = router.Generate(_ids_request("victim"), ctx)
            first = await victim.__anext__()
            # (Bounded: a duplicate that reached the pod would wait there.)
            duplicate = _drain(router.Generate(_ids_request("victim"), ctx))
            _, refused = await asyncio.wait_for(duplicate, 10)
            duplicate_metadata = context.metadata
            answer = await router.Abort(pb.AbortRequest(request_ids=["victim", "other"]), ctx)
            rest, error = await _drain(victim)
            return first, refused, duplicate_metadata, answer, rest, error
        finally:
            await decode.close()

    first, refused, metadata, answer, rest, error = asyncio.run(go())
    assert isinstance(first, pb.GenerateResponse) and first.request_id == "victim"
    (leg,) = pod.requests  # the duplicate reached no pod
    assert leg.request_id.startswith("victim-") and leg.request_id != "victim"
    assert isinstance(refused, _Aborted) and refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details == "request_id: 'victim' is already in use by a live request"
    assert metadata == refused_metadata(True)
    assert pod.aborts == [[leg.request_id]]
    assert isinstance(answer, pb.AbortResponse)
    assert list(answer.aborted_request_ids) == ["victim"]
    assert error is None and isinstance(rest, list)
    assert [r.request_id for r in rest] == ["victim"] * len(rest)


def test_a_pods_unasked_abort_is_never_an_answer() -> None:
    """A pod that aborts a leg the client did not abort (its drain's grace
    ran out): before anything reached the client another pod answers;
    after, the call ends UNAVAILABLE."""
    draining = _GenPodStub(lambda r: _answer([], pb.FINISH_REASON_ABORT))
    fine = _GenPodStub(lambda r: _answer([7, 8], pb.FINISH_REASON_LENGTH))
    midway = _GenPodStub(lambda r: [*_answer([7], 0), *_answer([], pb.FINISH_REASON_ABORT)])

    async def go(stubs: list[_GenPodStub]) -> tuple[list[pb.GenerateResponse], _Aborted | None]:
        decode = _scripted("decode", stubs, [{} for _ in stubs])
        decode.pods[-1].load = 5.0  # the draining pod is picked first
        try:
            router = RouterServicer(None, decode)
            ctx = cast(grpc.aio.ServicerContext, _Context())
            return await _drain(router.Generate(_ids_request("r"), ctx))
        finally:
            await decode.close()

    got, error = asyncio.run(go([draining, fine]))
    assert error is None and [t for r in got for t in r.token_ids] == [7, 8]
    assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    got, error = asyncio.run(go([midway]))
    assert [t for r in got for t in r.token_ids] == [7]
    assert error is not None and error.code == grpc.StatusCode.UNAVAILABLE
    assert error.details == "decode pod aborted the request before it finished; retry it"


def _pd_router(
    prefill_keys: list[str], decode_keys: list[str]
) -> tuple[RouterServicer, list[_GenPodStub], list[_GenPodStub]]:
    """Pods with the adapter "a" from the files whose cache keys are given."""
    prefill = [
        _GenPodStub(lambda r: _answer([7], pb.FINISH_REASON_LENGTH, 8, True)) for _ in prefill_keys
    ]
    # The decode pod reports the whole prompt cached: it was handed its KV.
    decode = [
        _GenPodStub(lambda r: _answer([8, 9], pb.FINISH_REASON_LENGTH, 9)) for _ in decode_keys
    ]
    router = RouterServicer(
        _scripted("prefill", prefill, [{"a": k} for k in prefill_keys]),
        _scripted("decode", decode, [{"a": k} for k in decode_keys]),
    )
    return router, prefill, decode


async def _close(router: RouterServicer) -> None:
    for pool in router._pools():
        await pool.close()


def test_both_legs_run_the_same_adapter_files() -> None:
    """A name loaded from different files: the prefill leg goes to the pod
    whose files a decode pod has too, and the decode leg to that decode pod."""

    async def go() -> tuple[RouterServicer, list[_GenPodStub], list[_GenPodStub]]:
        router, prefill, decode = _pd_router(["lora:x", "lora:y"], ["lora:z", "lora:y"])
        router.prefill.pods[1].load = 5.0  # type: ignore[union-attr]  # busier, yet the one
        ctx = cast(grpc.aio.ServicerContext, _Context())
        try:
            got, error = await _drain(router.Generate(_ids_request("r", lora="a"), ctx))
            assert error is None and [t for r in got for t in r.token_ids] == [7, 8, 9]
        finally:
            await _close(router)
        return router, prefill, decode

    _, prefill, decode = asyncio.run(go())
    assert [len(s.requests) for s in prefill] == [0, 1]
    assert [len(s.requests) for s in decode] == [0, 1]


def test_pools_with_an_adapters_name_from_different_files_are_refused() -> None:
    async def go() -> tuple[_Aborted | None, list[_GenPodStub], list[_GenPodStub]]:
        router, prefill, decode = _pd_router(["lora:x"], ["lora:y"])
        ctx = cast(grpc.aio.ServicerContext, _Context())
        try:
            _, error = await _drain(router.Generate(_ids_request("r", lora="a"), ctx))
        finally:
            await _close(router)
        return error, prefill, decode

    error, prefill, decode = asyncio.run(go())
    assert error is not None and error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details == (
        "lora_name: LoRA adapter 'a' differs between the pools: no prefill and decode pod "
        "have it from the same files (cache keys: decode ['lora:y'], prefill ['lora:x']); "
        "load the same files under that name on both"
    )
    assert not prefill[0].requests and not decode[0].requests


def test_pd_usage_counts_the_prefill_pods_cache_hit_as_colocated_would() -> None:
    async def go() -> list[pb.GenerateResponse]:
        router, _, _ = _pd_router(["lora:x"], ["lora:x"])
        ctx = cast(grpc.aio.ServicerContext, _Context())
        try:
            got, error = await _drain(router.Generate(_ids_request("r"), ctx))
            assert error is None
            return got
        finally:
            await _close(router)

    last = asyncio.run(go())[-1]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (9, 3)
    assert last.usage.cached_tokens == 8  # the prefill pod's hit, not the decode pod's 9
