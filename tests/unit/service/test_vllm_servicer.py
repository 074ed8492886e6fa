"""The VllmEngine contract (smg's engine protocol) over an in-process gRPC
server, in front of an AsyncEngine with a scripted core (token 42 per step)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.async_engine import AsyncEngine
from engine.kv_transfer.params import KVTransferParams
from engine.structured_output.params import StructuredOutputParams
from service.errors import was_refused
from service.grpc_server import new_server
from service.servicer import new_input_pool
from service.vllm_servicer import VllmEngineServicer
from tests.unit.engine.scripted_core import ScriptedCore, start_engine

Body = Callable[
    [vpb_grpc.VllmEngineStub, VllmEngineServicer, ScriptedCore, AsyncEngine], Awaitable[Any]
]


def serve(
    body: Body,
    *,
    role: str = "both",
    hold_kv: bool = False,
    attach: bool = True,
    lora_name: str | None = None,
) -> Any:
    """Runs ``body`` against a servicer on a real gRPC server and channel
    (``lora_name``: an adapter port's servicer, service/adapter_ports.py)."""

    async def go() -> Any:
        core = ScriptedCore(hold_kv=hold_kv)
        engine = await start_engine(core)
        servicer = VllmEngineServicer(
            new_input_pool(),
            role=role,
            kv_connector="",
            served_model_name="smol",
            lora_name=lora_name,
        )
        if attach:
            servicer.attach(engine)
        server = new_server()
        vpb_grpc.add_VllmEngineServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await body(vpb_grpc.VllmEngineStub(channel), servicer, core, engine)
        finally:
            await server.stop(0)
            await engine.shutdown()

    return asyncio.run(go())


def generate(rid: str = "r1", *, stream: bool = True, **sampling: Any) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=rid,
        tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vpb.SamplingParams(**{"max_tokens": 3, **sampling}),
        stream=stream,
    )


async def collect(call: AsyncIterator[vpb.GenerateResponse]) -> list[vpb.GenerateResponse]:
    return [r async for r in call]


# --- Generate --------------------------------------------------------------------


def test_a_streamed_generate_sends_deltas_then_a_complete_with_the_last_delta() -> None:
    async def body(stub, *_: Any) -> list[vpb.GenerateResponse]:
        return await collect(stub.Generate(generate(max_tokens=3)))

    responses = serve(body)
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[-2:] == ["chunk", "complete"] and set(kinds[:-1]) == {"chunk"}
    chunks = [r.chunk for r in responses[:-1]]
    assert [t for c in chunks for t in c.token_ids] == [42, 42, 42]
    assert sum(c.completion_tokens for c in chunks) == 3  # deltas: smg adds them up
    assert all(c.prompt_tokens == 3 for c in chunks)
    done = responses[-1].complete
    assert done.finish_reason == "length" and done.index == 0
    assert list(done.output_ids) == list(chunks[-1].token_ids)  # as vLLM's servicer
    assert done.prompt_tokens == 3
    assert not done.HasField("kv_transfer_params_json")


def test_an_unstreamed_generate_sends_one_complete_with_the_whole_output() -> None:
    async def body(stub, *_: Any) -> list[vpb.GenerateResponse]:
        return await collect(stub.Generate(generate(stream=False, max_tokens=4)))

    (only,) = serve(body)
    assert only.WhichOneof("response") == "complete"
    assert list(only.complete.output_ids) == [42] * 4
    assert only.complete.completion_tokens == 4 and only.complete.finish_reason == "length"


def test_n_choices_run_as_n_engine_requests_each_with_its_own_complete() -> None:
    async def body(stub, *_: Any) -> list[vpb.GenerateResponse]:
        return await collect(stub.Generate(generate("multi", stream=False, n=3, max_tokens=2)))

    responses = serve(body)
    assert sorted(r.complete.index for r in responses) == [0, 1, 2]
    assert all(list(r.complete.output_ids) == [42, 42] for r in responses)


def test_each_choice_is_seeded_with_the_seed_plus_its_index() -> None:
    """As vLLM seeds its child requests: n seeded choices differ, and the
    same request again gives the same n."""

    async def body(stub, servicer, core, engine) -> dict[str, int | None]:
        call = stub.Generate(generate("multi", n=3, max_tokens=10_000, seed=7))
        await call.read()
        seeds = {rid: r.sampling_params.seed for rid, r in core.live.items()}
        call.cancel()
        return seeds

    assert serve(body) == {"multi-0": 7, "multi-1": 8, "multi-2": 9}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.ClearField("request_id"), "request_id"),
        (lambda r: r.ClearField("input"), "input"),
        (
            lambda r: r.sampling_params.__setattr__("json_schema", "{nope"),
            "sampling_params.json_schema: is not valid JSON",
        ),
        (
            lambda r: r.sampling_params.__setattr__(
                "json_schema", '{"type": "integer", "not": {"const": 3}}'
            ),
            "sampling_params.json_schema.not: 'not' is not enforced",
        ),
        (lambda r: r.sampling_params.choice.choices.extend(["a", ""]), "sampling_params.choice[1]"),
        (
            lambda r: r.sampling_params.__setattr__("structural_tag", "{}"),
            "sampling_params.structural_tag",
        ),
        (lambda r: r.sampling_params.__setattr__("logprobs", -1), "sampling_params.logprobs"),
        (
            lambda r: r.sampling_params.__setattr__("truncate_prompt_tokens", 2),
            "sampling_params.truncate_prompt_tokens",
        ),
        (lambda r: r.sampling_params.__setattr__("n", 17), "sampling_params.n"),
        (
            lambda r: r.sampling_params.__setattr__("temperature", -1.0),
            "sampling_params.temperature",
        ),
        (lambda r: r.sampling_params.__setattr__("top_p", 1.5), "sampling_params.top_p"),
        (lambda r: r.tokenized.input_ids.append(10**6), "tokenized.input_ids"),
        (lambda r: r.__setattr__("kv_transfer_params_json", "{nope"), "kv_transfer_params_json"),
        (lambda r: r.__setattr__("kv_transfer_params_json", "[1]"), "kv_transfer_params_json"),
        (
            lambda r: r.__setattr__("kv_transfer_params_json", '{"bogus": 1}'),
            "kv_transfer_params_json.bogus",
        ),
    ],
)
def test_bad_or_unsupported_input_is_invalid_argument_naming_the_field(
    change: Callable[[vpb.GenerateRequest], object], field: str
) -> None:
    request = generate()
    change(request)

    async def body(stub, servicer, core, engine) -> tuple[grpc.StatusCode, str, int]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(request))
        return err.value.code(), err.value.details() or "", engine.num_live

    code, details, live = serve(body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field), details
    assert live == 0


def test_a_constraint_reaches_the_engine_as_structured_outputs() -> None:
    request = generate("so", max_tokens=10_000)
    request.sampling_params.regex = "[0-9]+"

    async def body(stub, servicer, core, engine) -> object:
        call = stub.Generate(request)
        await call.read()
        so = core.live["so"].sampling_params.structured_outputs
        call.cancel()
        return so

    assert serve(body) == StructuredOutputParams(regex="[0-9]+")


def test_a_prefill_pod_asks_its_connector_to_hand_over_requests_that_carry_no_params() -> None:
    async def body(stub, servicer, core, engine) -> tuple[Any, Any]:
        call = stub.Generate(generate("p1", max_tokens=50))
        await call.read()
        own = core.live["p1"].kv_transfer_params
        relayed = generate("p2", max_tokens=50)
        relayed.kv_transfer_params_json = json.dumps({"do_remote_prefill": True, "num_blocks": 2})
        call2 = stub.Generate(relayed)
        await call2.read()
        theirs = core.live["p2"].kv_transfer_params
        call.cancel()
        call2.cancel()
        return own, theirs

    own, theirs = serve(body, role="prefill")
    assert own == KVTransferParams(do_remote_decode=True)
    assert theirs == KVTransferParams(do_remote_prefill=True, num_blocks=2)


def test_n_above_one_is_refused_with_disaggregation() -> None:
    async def body(stub, *_: Any) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(generate(n=2)))
        return err.value.code()

    assert serve(body, role="prefill") == grpc.StatusCode.INVALID_ARGUMENT


def test_an_id_the_scheduler_still_holds_is_refused_with_the_refused_marker() -> None:
    """A finished prefill leg's id, its KV held for a decode pod: the new
    request never ran, and says so (the holder's KV must not be released)."""

    async def body(stub, servicer, core: ScriptedCore, engine) -> grpc.aio.AioRpcError:
        core.held.add("held")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(generate("held")))
        return err.value

    error = serve(body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in use by a finished request" in (error.details() or "")
    assert was_refused(error)


# --- Abort -----------------------------------------------------------------------


def test_abort_ends_live_choices_releases_held_kv_and_is_idempotent() -> None:
    async def body(stub, servicer, core, engine) -> tuple[list[str], list[str], int]:
        call = stub.Generate(generate("live", n=2, max_tokens=10_000, stream=True))
        await call.read()
        held = await collect(stub.Generate(generate("held", max_tokens=1)))
        assert held[-1].complete.finish_reason == "length"
        for _ in range(3):  # smg may send it more than once
            await stub.Abort(vpb.AbortRequest(request_ids=["live", "held", "unknown"]))
        rest = []
        while (response := await call.read()) != grpc.aio.EOF:
            rest.append(response)
        for _ in range(500):
            if core.released:
                break
            await asyncio.sleep(0.01)
        finishes = [
            r.complete.finish_reason for r in rest if r.WhichOneof("response") == "complete"
        ]
        return finishes, core.released, engine.num_live

    finishes, released, live = serve(body, hold_kv=True)
    assert finishes == ["abort", "abort"]
    assert "held" in released and "unknown" in released
    assert live == 0


def test_a_cancelled_stream_aborts_its_requests() -> None:
    async def body(stub, servicer, core, engine: AsyncEngine) -> int:
        call = stub.Generate(generate("gone", n=2, max_tokens=10_000))
        await call.read()
        call.cancel()
        for _ in range(500):
            if engine.num_live == 0:
                break
            await asyncio.sleep(0.01)
        return engine.num_live

    assert serve(body) == 0


# --- health, facts ---------------------------------------------------------------


def test_health_follows_loading_and_draining() -> None:
    async def body(stub, servicer, core, engine) -> list[tuple[bool, str]]:
        states = []
        states.append(await stub.HealthCheck(vpb.HealthCheckRequest()))
        servicer.attach(engine)
        states.append(await stub.HealthCheck(vpb.HealthCheckRequest()))
        engine.begin_drain()
        states.append(await stub.HealthCheck(vpb.HealthCheckRequest()))
        return [(s.healthy, s.message) for s in states]

    loading, ok, draining = serve(body, attach=False)
    assert loading == (False, "the model is still loading")
    assert ok == (True, "healthy")
    assert draining == (False, "draining")


def test_rpcs_other_than_health_are_unavailable_while_loading() -> None:
    async def body(stub, *_: Any) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetModelInfo(vpb.GetModelInfoRequest())
        return err.value.code()

    assert serve(body, attach=False) == grpc.StatusCode.UNAVAILABLE


def test_model_server_and_load_facts() -> None:
    async def body(stub, servicer, core, engine) -> tuple[Any, Any, Any]:
        return (
            await stub.GetModelInfo(vpb.GetModelInfoRequest()),
            await stub.GetServerInfo(vpb.GetServerInfoRequest()),
            await stub.GetLoads(vpb.GetLoadsRequest()),
        )

    model, server, loads = serve(body)
    assert model.served_model_name == "smol"
    assert model.max_context_length == 64 and model.max_req_input_len == 63
    assert model.vocab_size == 49152 and model.is_generation
    assert list(model.architectures) == ["LlamaForCausalLM"] and model.model_type == "llama"
    assert model.tokenizer_path == model.model_path and model.tokenizer_path
    assert server.kv_connector == "" and server.kv_role == ""
    assert server.block_size == 16 and server.model_dtype == "torch.float32"
    assert server.kv_cache_dtype == "auto"  # the stand-in's cache is in the model's dtype
    assert server.max_num_seqs == 256
    (load,) = loads.loads
    assert load.num_running_reqs == 0 and load.max_running_requests == 256
    assert load.max_total_num_tokens == 7 * 16  # 8 blocks, one the null block


def test_an_adapter_port_names_its_adapter_and_is_not_found_while_it_is_not_loaded() -> None:
    """smg answers NOT_FOUND with HTTP 404 (vLLM's answer to an unknown
    model) and the message naming the adapter; nothing reaches the engine."""

    async def body(stub, servicer, core, engine) -> tuple[str, grpc.StatusCode, str, int]:
        info = await stub.GetModelInfo(vpb.GetModelInfoRequest())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(generate()))
        return info.served_model_name, err.value.code(), err.value.details() or "", len(core.live)

    name, code, details, live = serve(body, lora_name="qv8")
    assert name == "qv8"
    assert code == grpc.StatusCode.NOT_FOUND
    assert details.startswith("model 'qv8': the LoRA adapter is not loaded on this pod")
    assert live == 0


def test_the_tokenizer_bundle_is_a_zip_of_the_models_tokenizer_files() -> None:
    async def body(stub, *_: Any) -> list[common_pb2.GetTokenizerChunk]:
        return [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]

    chunks = serve(body)
    data = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)


def test_the_kv_event_stream_answers_at_once_on_an_idle_pod() -> None:
    """smg gives up on a stream whose headers take over 2 s."""

    async def body(stub, *_: Any) -> tuple[Any, ...]:
        call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        metadata = await asyncio.wait_for(call.initial_metadata(), 1.0)
        call.cancel()
        return tuple(metadata)

    assert serve(body) == ()


def test_flush_cache_succeeds_when_idle_and_waits_for_running_requests() -> None:
    async def body(stub, servicer, core, engine) -> list[tuple[bool, str]]:
        idle = await stub.FlushCache(common_pb2.FlushCacheRequest())
        call = stub.Generate(generate("busy", max_tokens=10_000))
        await call.read()
        busy = await stub.FlushCache(common_pb2.FlushCacheRequest())
        waited = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0.2))
        call.cancel()
        return [(r.success, r.message) for r in (idle, busy, waited)]

    idle, busy, waited = serve(body)
    assert idle[0] and not busy[0] and not waited[0]
    assert "timeout_s" in busy[1] and "still running" in waited[1]
