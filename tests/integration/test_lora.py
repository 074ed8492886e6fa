"""LoRA adapters over gRPC, against one real `tandem serve --enable-lora`.

The server starts with one adapter (`--lora-modules qv8=...`: the session's
adapters, made with peft by tests/conftest.py, whose transformers + peft
reference is computed while the server starts): greedy output under it
equals peft's token for token, and the base model's equals the base
reference. At run time an adapter is loaded, listed (ListLoraAdapters,
status, model info), served, and unloaded; unknown names and bad
directories are INVALID_ARGUMENT naming what is wrong; an adapter unloaded
while a stream uses it finishes that stream whole. The endpoint pickers'
gauges (vllm:*) name the adapters of running and waiting requests. The
session's server
(no LoRA) answers FAILED_PRECONDITION to loads, and a router in front of
both sends adapter requests only to the pod that has the adapter.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.client import TandemClient
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.servers import ServerProcess, serving
from tests.integration.test_router import _wait_pods_healthy
from tests.lora_adapters import MAX_TOKENS, TEXTS

T = TypeVar("T")

# The prompt sent: every adapter changes its greedy answer within
# MAX_TOKENS, and qv8's has no EOS there (peft's reference stops at EOS;
# the server's requests ignore it).
PROMPT = TEXTS.index("Write a haiku about the sea.")


@dataclass(frozen=True)
class LoraServer:
    server: ServerProcess
    adapters: dict[str, Path]  # qv8 (loaded at start), attn16 (loaded by tests), ...
    prompt: list[int]
    reference: dict[str | None, list[int]]  # peft's greedy tokens for prompt, None: base


@pytest.fixture(scope="module")
def lora(
    request: pytest.FixtureRequest,
    lora_adapters: dict[str, Path],
    lora_prompts: list[list[int]],
) -> Iterator[LoraServer]:
    small = ["--max-num-seqs", "8", "--max-model-len", "1024", "--kv-cache-memory", "128M"]
    args = [*small, "--enable-lora", "--max-loras", "2"]
    server = ServerProcess([*args, "--lora-modules", f"qv8={lora_adapters['qv8']}"], metrics=True)
    server.start()  # its start-up overlaps the reference's computation
    try:
        # The session's reference: computed here (overlapping the start-up)
        # unless an earlier module asked for it.
        reference = request.getfixturevalue("lora_reference")
    except BaseException:
        server.kill()
        raise
    rows = {name: outs[PROMPT] for name, outs in reference.items()}
    with server:  # waits for SERVING; drains it (exit code 0) at the end
        yield LoraServer(server, lora_adapters, lora_prompts[PROMPT], rows)


def _run(fn: Callable[[TandemClient], Awaitable[T]], target: str) -> T:
    """`fn(client)` with a client of `target`, on a fresh event loop."""

    async def go() -> T:
        async with TandemClient(target) as client:
            return await fn(client)

    return asyncio.run(go())


async def _tokens(
    client: TandemClient, prompt: list[int], lora: str = "", max_tokens: int = MAX_TOKENS
) -> list[int]:
    """Greedy tokens under `lora` ("": the base model)."""
    chunks = client.generate(
        token_ids=prompt, lora_name=lora, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )
    return [t async for c in chunks for t in c.token_ids]


async def _error(call: Awaitable[object] | AsyncIterator[object]) -> grpc.aio.AioRpcError:
    """The error a unary call or a stream ends with (it must end with one)."""
    try:
        if isinstance(call, AsyncIterator):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError("the call succeeded")


def test_an_adapter_loaded_at_start_equals_peft(lora: LoraServer) -> None:
    async def go(client: TandemClient) -> tuple[list[int], list[int], pb.ModelInfo]:
        return (
            await _tokens(client, lora.prompt, "qv8"),
            await _tokens(client, lora.prompt),
            await client.model_info(),
        )

    adapted, base, info = _run(go, lora.server.target)
    assert adapted == lora.reference["qv8"]
    assert base == lora.reference[None] != adapted
    assert info.HasField("lora") and info.lora.max_loras == 2
    # --exact (every test server's, as peft's float32 reference needs), as GetModelInfo says.
    assert (info.numerics, info.activations, info.kv_cache_dtype) == ("exact", "float", "float32")
    assert [a.lora_name for a in info.lora_adapters] == ["qv8"]


def test_load_list_serve_and_unload_at_run_time(lora: LoraServer) -> None:
    path = str(lora.adapters["attn16"])

    @dataclass
    class Seen:
        loaded: pb.LoraAdapter
        listed: list[str]
        status: list[str]
        runs: list[list[int]]
        again: grpc.aio.AioRpcError
        unloaded: pb.LoraAdapter
        after: list[str]
        refused: grpc.aio.AioRpcError
        unknown: grpc.aio.AioRpcError

    async def go(client: TandemClient) -> Seen:
        return Seen(
            loaded=await client.load_lora("attn16", path),
            listed=[a.lora_name for a in await client.list_loras()],
            status=[a.lora_name for a in (await client.status()).lora_adapters],
            runs=[await _tokens(client, lora.prompt, "attn16") for _ in range(2)],
            again=await _error(client.load_lora("attn16", path)),
            unloaded=await client.unload_lora("attn16"),
            after=[a.lora_name for a in await client.list_loras()],
            refused=await _error(client.generate(token_ids=lora.prompt, lora_name="attn16")),
            unknown=await _error(client.unload_lora("attn16")),
        )

    seen = _run(go, lora.server.target)
    loaded = seen.loaded
    assert (loaded.lora_name, loaded.rank, loaded.lora_path) == ("attn16", 16, path)
    assert loaded.cache_key.startswith("lora:")
    assert seen.listed == seen.status == ["attn16", "qv8"]
    first, second = seen.runs
    assert first == second != lora.reference[None]  # the adapter applies, the same each time
    assert seen.again.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already loaded" in (seen.again.details() or "")
    assert seen.unloaded.lora_name == "attn16"
    assert seen.after == ["qv8"]
    for error in (seen.refused, seen.unknown):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "lora_name: unknown LoRA adapter 'attn16': loaded are ['qv8']"


def test_unloading_an_adapter_in_use_lets_its_stream_finish(lora: LoraServer) -> None:
    """ "twin" is qv8's files under another name: the stream's tokens must
    equal qv8's all the way, though "twin" is unloaded after the first."""
    n = 16  # a stream of ~1 s: the unload lands while it runs

    async def go(client: TandemClient) -> tuple[list[int], list[int], grpc.aio.AioRpcError, int]:
        await client.load_lora("twin", str(lora.adapters["qv8"]))
        call = client.stub.Generate(_greedy(lora.prompt, "twin", n), metadata=client.metadata)
        first = await call.read()
        assert isinstance(first, pb.GenerateResponse)
        await client.unload_lora("twin")
        refused = await _error(client.generate(token_ids=lora.prompt, lora_name="twin"))
        chunks = [first]
        while (msg := await call.read()) is not grpc.aio.EOF:
            chunks.append(msg)
        streamed = [t for c in chunks for t in c.token_ids]
        want = await _tokens(client, lora.prompt, "qv8", max_tokens=n)
        return streamed, want, refused, chunks[-1].finish_reason

    streamed, want, refused, reason = _run(go, lora.server.target)
    assert reason == pb.FINISH_REASON_LENGTH
    assert len(streamed) == n and streamed == want
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.details() or "").startswith("lora_name: unknown LoRA adapter 'twin'")


def _greedy(prompt: list[int], lora: str, n: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(lora_name=lora)
    request.token_ids.ids.extend(prompt)
    request.sampling.max_tokens = n
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    return request


def test_a_bad_adapter_directory_is_named(lora: LoraServer, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(
        (lora.adapters["qv8"] / "adapter_config.json").read_text()
    )  # no weights file

    async def go(client: TandemClient) -> list[grpc.aio.AioRpcError]:
        return [
            await _error(client.load_lora("bad", str(tmp_path))),
            await _error(client.load_lora("bad", str(tmp_path / "nowhere"))),
        ]

    missing, nowhere = _run(go, lora.server.target)
    for error in (missing, nowhere):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith("lora_path: "), error.details()
    assert "adapter_model.safetensors" in (missing.details() or "")
    assert "nowhere" in (nowhere.details() or "")


def test_a_server_without_lora_refuses_adapters(server: ServerProcess) -> None:
    async def go(client: TandemClient) -> tuple[object, ...]:
        return (
            await _error(client.load_lora("x", "/tmp")),
            await _error(client.generate(text="hi", lora_name="x")),
            await client.list_loras(),
            await client.model_info(),
        )

    load, generate, listed, info = _run(go, server.target)
    assert isinstance(load, grpc.aio.AioRpcError) and isinstance(generate, grpc.aio.AioRpcError)
    assert load.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-lora" in (load.details() or "")
    assert generate.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (generate.details() or "").startswith("lora_name: this server serves no LoRA")
    assert listed == [] and isinstance(info, pb.ModelInfo) and not info.HasField("lora")


Gauges = dict[str, list[tuple[dict[str, str], float]]]


def _picker_gauges(server: ServerProcess) -> Gauges:
    """The vllm:* families of the server's /metrics: (labels, value) per sample."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url).read().decode()
    return {
        f.name: [(s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(text)
        if f.name.startswith("vllm:")
    }


def _gauges_when(server: ServerProcess, running: int, waiting: int) -> Gauges:
    """The gauges once the server reports `running` and `waiting` requests."""
    deadline = time.monotonic() + 30
    while True:
        gauges = _picker_gauges(server)
        counts = [gauges[f"vllm:num_requests_{k}"][0][1] for k in ("running", "waiting")]
        if counts == [running, waiting] or time.monotonic() > deadline:
            return gauges
        time.sleep(0.05)


def test_the_endpoint_pickers_gauges_name_running_and_waiting_adapters(
    lora: LoraServer,
) -> None:
    """A full batch (8: 7 base, 1 qv8) with two behind it (one base, one
    under "wait8", qv8's files under another name): the gauges the Gateway
    API inference extension reads say so, by vLLM's names; when the calls
    are cancelled they go back to idle."""

    async def go(client: TandemClient) -> tuple[Gauges, Gauges]:
        await client.load_lora("wait8", str(lora.adapters["qv8"]))
        calls = []
        try:
            for adapter in ["qv8"] + [""] * 7 + ["wait8", ""]:
                call = client.stub.Generate(
                    _greedy(lora.prompt, adapter, 200), metadata=client.metadata
                )
                calls.append(call)
                if len(calls) <= 8:  # running (its first token came) before the next
                    assert isinstance(await call.read(), pb.GenerateResponse)
            busy = await asyncio.to_thread(_gauges_when, lora.server, 8, 2)
        finally:
            for call in calls:
                call.cancel()
            idle = await asyncio.to_thread(_gauges_when, lora.server, 0, 0)
            await client.unload_lora("wait8")
        return busy, idle

    busy, idle = _run(go, lora.server.target)
    labels = {"model_name": "SmolLM2-135M-Instruct", "engine": "0"}
    counts = [busy[f"vllm:num_requests_{k}"] for k in ("running", "waiting")]
    assert counts == [[(labels, 8.0)], [(labels, 2.0)]]
    [(usage_labels, usage)] = busy["vllm:kv_cache_usage_perc"]
    assert usage_labels == labels and 0 < usage < 1
    assert busy["vllm:gpu_cache_usage_perc"] == busy["vllm:kv_cache_usage_perc"]
    [(info, stamp)] = busy["vllm:lora_requests_info"]
    assert info == {
        "max_lora": "2",
        "running_lora_adapters": "qv8",
        "waiting_lora_adapters": "wait8",
    }
    assert abs(stamp - time.time()) < 60  # wall-clock seconds, as vLLM's
    assert idle["vllm:num_requests_running"] == idle["vllm:num_requests_waiting"] == [(labels, 0.0)]
    [(info, _)] = idle["vllm:lora_requests_info"]
    assert info == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def test_the_router_sends_adapter_requests_only_where_the_adapter_is(
    lora: LoraServer, server: ServerProcess
) -> None:
    """Two colocated pods, one with qv8: qv8 requests get peft's tokens
    (the other pod, first among equals, would refuse them); a load that
    one pod refuses (no LoRA there) is undone on the other."""
    args = ["--decode", f"{server.target},{lora.server.target}", "--poll-seconds", "0.2"]
    with ServerProcess(args, command="router") as router:
        assert _wait_pods_healthy(router.target, 2) == 2

        async def go(client: TandemClient) -> tuple[object, ...]:
            runs = [await _tokens(client, lora.prompt, "qv8") for _ in range(2)]
            unknown = await _error(client.generate(token_ids=lora.prompt, lora_name="nope"))
            listed = [a.lora_name for a in await client.list_loras()]
            load = await _error(client.load_lora("attn16", str(lora.adapters["attn16"])))
            return runs, unknown, listed, load

        runs, unknown, listed, load = _run(go, router.target)
    after = _run(lambda c: c.list_loras(), lora.server.target)
    assert runs == [lora.reference["qv8"]] * 2
    assert isinstance(unknown, grpc.aio.AioRpcError)
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unknown.details() == "lora_name: unknown LoRA adapter 'nope': loaded are ['qv8']"
    assert listed == ["qv8"]
    assert isinstance(load, grpc.aio.AioRpcError)
    assert load.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert [a.lora_name for a in after] == ["qv8"]  # attn16 unloaded again


def test_the_router_refuses_an_adapter_its_pools_load_from_different_files(
    lora_adapters: dict[str, Path],
) -> None:
    """The prefill pool's "poems" is qv8's files, the decode pool's attn16's:
    KV the prefill pod computes under one is wrong under the other, so the
    router sends neither leg and names the adapter and the disagreement."""
    args = ["--max-num-seqs", "4", "--max-model-len", "512", "--kv-cache-memory", "64M"]
    args += ["--enable-lora", "--max-loras", "1"]
    prefill = ServerProcess([*args, "--lora-modules", f"poems={lora_adapters['qv8']}"])
    decode = ServerProcess([*args, "--lora-modules", f"poems={lora_adapters['attn16']}"])
    router = ServerProcess(
        ["--prefill", prefill.target, "--decode", decode.target, "--poll-seconds", "0.2"],
        command="router",
    )
    with serving(prefill, decode, router):
        assert _wait_pods_healthy(router.target, 2) == 2
        error = _run(
            lambda c: _error(c.generate(token_ids=[1, 2, 3], lora_name="poems")), router.target
        )
        pods = (prefill, decode)
        keys = [_run(lambda c: c.list_loras(), pod.target)[0].cache_key for pod in pods]
        # A request an engine took would have queried its prefix cache.
        queries = [_run(lambda c: c.status(), pod.target).prefix_cache_queries for pod in pods]
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = error.details() or ""
    assert details.startswith("lora_name: LoRA adapter 'poems' differs between the pools"), details
    assert keys[0] != keys[1] and all(key in details for key in keys)
    assert queries == [0, 0]  # neither leg was sent
