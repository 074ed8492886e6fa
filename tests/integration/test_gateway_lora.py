"""LoRA adapters through a real smg, driven with the `openai` client.

One `tandem serve --enable-lora` pod serves the base model on its port and
each adapter on its own (`--lora-port`, service/adapter_ports.py): smg sees
one worker per model and routes a request by its `model`. qv8 and attn16
are loaded at start; twin (qv8's files under another name) has a port but
is loaded by the test that unloads it mid-burst. The references are the
same pod's answers over tandem.v1 with `lora_name` (what `tandem generate
--lora --chat` sends). A prefill and a decode pod over shared memory, each
with qv8 on a port of its own, show the same behind smg in P/D mode. What
smg drops (a request's `priority` and `cache_salt`: neither of its engine
protocols carries them) is pinned as documented in docs/serving.md; the
pod schedules by priority, so a priority that arrived would show.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from service.client import TandemClient, make_request
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.gateway import MODEL, SmgGateway
from tests.integration.servers import ServerProcess, free_port, launched

QUESTION = "Write a haiku about the sea."
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
MAX_TOKENS = 12
ADAPTERS = ("qv8", "attn16")


@dataclass(frozen=True)
class LoraGateway:
    server: ServerProcess
    gateway: SmgGateway
    client: openai.OpenAI
    adapters: dict[str, Path]


SMALL = ["--max-num-seqs", "8", "--max-model-len", "1024", "--kv-cache-memory", "128M"]


@dataclass(frozen=True)
class PdPods:
    prefill: ServerProcess
    decode: ServerProcess
    qv8_workers: tuple[str, str]  # the prefill's and the decode's qv8 port


@pytest.fixture(scope="module")
def pd_pods(lora_adapters: dict[str, Path]) -> Iterator[PdPods]:
    """A prefill and a decode pod sharing KV over shared memory, each with
    qv8 on its own port; launched before the colocated pod (whose fixture
    asks for them) so that their start-ups overlap."""
    extra = {"pool_name": f"lora-pd-{uuid.uuid4().hex[:8]}", "capacity_bytes": 128 << 20}
    lora = ["--exact", "--enable-lora", "--lora-modules", f"qv8={lora_adapters['qv8']}"]
    pods, workers = [], []
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        kv = {"kv_connector": "shm", "kv_role": kv_role, "kv_connector_extra_config": extra}
        port = free_port()
        args = ["--role", role, "--kv-transfer-config", json.dumps(kv), *SMALL, *lora]
        pod = ServerProcess([*args, "--lora-port", f"qv8={port}"])
        pods.append(pod)
        workers.append(f"127.0.0.1:{port}")
    with launched(*pods):
        yield PdPods(pods[0], pods[1], (workers[0], workers[1]))


@pytest.fixture(scope="module")
def lora_gateway(lora_adapters: dict[str, Path], pd_pods: PdPods) -> Iterator[LoraGateway]:
    ports = {name: free_port() for name in (*ADAPTERS, "twin")}
    modules = [f"{name}={lora_adapters[name]}" for name in ADAPTERS]
    # --exact: greedy answers that do not depend on what else runs in the
    # step (the fast path's int8 activations and bfloat16 KV cache can flip
    # a near-tie between a burst and the reference's requests).
    args = [*SMALL, "--exact", "--enable-lora", "--max-loras", "2", "--lora-modules", *modules]
    # Priorities decide admission (all equal elsewhere: first come, first served).
    args += ["--scheduling-policy", "priority"]
    for name, port in ports.items():
        args += ["--lora-port", f"{name}={port}"]
    with ServerProcess(args) as server:
        workers = [server.target, *(f"127.0.0.1:{port}" for port in ports.values())]
        with SmgGateway(workers=workers) as gateway:
            yield LoraGateway(server, gateway, gateway.openai(timeout=120.0), lora_adapters)


@pytest.fixture(scope="module")
def pd_gateway(pd_pods: PdPods) -> Iterator[tuple[SmgGateway, str]]:
    """smg in P/D mode in front of both models of the P/D pods; yields it
    and the decode pod's tandem.v1 address."""
    prefill, decode = pd_pods.prefill, pd_pods.decode
    # Entering a launched pod waits for SERVING; leaving drains it.
    with (
        prefill,
        decode,
        SmgGateway(
            prefill=[prefill.target, pd_pods.qv8_workers[0]],
            decode=[decode.target, pd_pods.qv8_workers[1]],
        ) as gateway,
    ):
        yield gateway, decode.target


def _chat(client: openai.OpenAI, model: str) -> str:
    got = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return got.choices[0].message.content or ""


async def _tandem_v1(target: str, lora: str, max_tokens: int = MAX_TOKENS) -> str:
    """The pod's greedy chat answer over tandem.v1 under `lora`."""
    async with TandemClient(target) as client:
        chunks = client.generate(
            messages=[{"role": "user", "content": QUESTION}],
            lora_name=lora,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        return "".join([c.text async for c in chunks])


def test_models_lists_the_base_and_every_adapter_port(lora_gateway: LoraGateway) -> None:
    ids = {m.id for m in lora_gateway.client.models.list().data}
    assert ids == {MODEL, *ADAPTERS, "twin"}


def test_a_burst_of_two_adapters_and_the_base_equals_tandem_v1(
    lora_gateway: LoraGateway,
) -> None:
    """Nine concurrent chats, three per model: each equals the same pod's
    answer over tandem.v1 under that adapter, and the adapters change it."""
    models = [MODEL, *ADAPTERS] * 3
    with ThreadPoolExecutor(len(models)) as pool:
        got = list(pool.map(lambda m: _chat(lora_gateway.client, m), models))

    async def references() -> list[str]:
        target = lora_gateway.server.target
        return list(await asyncio.gather(*(_tandem_v1(target, a) for a in ("", *ADAPTERS))))

    want = dict(zip([MODEL, *ADAPTERS], asyncio.run(references()), strict=True))
    assert got == [want[m] for m in models]
    assert len(set(want.values())) == 3  # each adapter answers otherwise than the base


def test_an_unknown_model_is_404(lora_gateway: LoraGateway) -> None:
    with pytest.raises(openai.NotFoundError):
        _chat(lora_gateway.client, "no-such-adapter")


def test_an_adapter_unloaded_mid_burst_finishes_its_streams_and_refuses_new_ones(
    lora_gateway: LoraGateway,
) -> None:
    """twin is loaded (qv8's files), three streams start on it, and it is
    unloaded once each has its first chunk: they run to the end with qv8's
    tokens, and a request after the unload is 404 naming the adapter."""
    server, client = lora_gateway.server, lora_gateway.client
    n = 24  # long enough that the unload lands while every stream runs

    async def load() -> None:
        async with TandemClient(server.target) as c:
            await c.load_lora("twin", str(lora_gateway.adapters["qv8"]))

    asyncio.run(load())
    started = threading.Barrier(4)

    def stream() -> tuple[str, str | None]:
        chunks = client.chat.completions.create(
            model="twin",
            messages=MESSAGES,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts: list[str] = []
        finish = None
        for chunk in chunks:
            if chunk.choices:
                if not parts:
                    started.wait(timeout=60)
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def unload() -> int:
        """Unloads twin; returns how many requests still run after it."""
        async with TandemClient(server.target) as c:
            await c.unload_lora("twin")
            return (await c.status()).num_running

    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream) for _ in range(3)]
        started.wait(timeout=60)
        assert asyncio.run(unload()) > 0  # the unload landed mid-stream
        with pytest.raises(openai.NotFoundError, match=r"twin.*not loaded"):
            _chat(client, "twin")
        results = [s.result(timeout=120) for s in streams]
    want = asyncio.run(_tandem_v1(server.target, "qv8", max_tokens=n))
    assert results == [(want, "length")] * 3


def test_a_cache_salt_does_not_reach_the_pod(lora_gateway: LoraGateway) -> None:
    """smg takes the field and passes it on in neither protocol
    (docs/serving.md): the answer is the same, and a salted request still
    hits the prefix cache that unsalted ones filled (a salt that arrived
    would miss it)."""
    client = lora_gateway.client
    plain = _chat(client, MODEL)
    got = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "priority": -5, "cache_salt": "tenant-a"},
    )
    assert got.choices[0].message.content == plain
    usage = got.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= 16


def test_pd_over_shared_memory_carries_the_adapter_on_both_legs(
    pd_gateway: tuple[SmgGateway, str], lora_gateway: LoraGateway
) -> None:
    """smg pairs a model's prefill and decode workers: the base model's and
    qv8's chats, in one burst, equal the colocated pod's, and the decode pod
    loaded their prompts' KV from the prefill pod (its connector hits)."""
    gateway, decode = pd_gateway

    async def hits() -> int:
        async with TandemClient(decode) as c:
            return (await c.status()).kv_connector_hits

    before = asyncio.run(hits())
    client = gateway.openai(timeout=120.0)
    models = [MODEL, "qv8"] * 2
    with ThreadPoolExecutor(len(models)) as pool:
        got = list(pool.map(lambda m: _chat(client, m), models))

    async def references() -> list[str]:
        target = lora_gateway.server.target
        return list(await asyncio.gather(_tandem_v1(target, ""), _tandem_v1(target, "qv8")))

    want = dict(zip([MODEL, "qv8"], asyncio.run(references()), strict=True))
    assert got == [want[m] for m in models]
    assert asyncio.run(hits()) - before >= 16  # at least one prompt's first block


def test_a_requests_priority_does_not_reach_the_pod(lora_gateway: LoraGateway) -> None:
    """Every slot of the pod (8) is taken and three requests queue: A over
    tandem.v1 at the default priority, B through smg with `"priority": -5`,
    C over tandem.v1 at -5. One slot frees: C overtakes A (the pod honours
    priorities), B does not (smg dropped its priority: it waits behind A,
    first come first served among equals)."""
    target, client = lora_gateway.server.target, lora_gateway.client
    finished: list[str] = []

    def through_smg() -> None:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True, "priority": -5},
        )
        finished.append("B")

    async def go(c: TandemClient) -> None:
        async def until(ready: Callable[[pb.ServerStatus], bool]) -> None:
            while not ready(await c.status()):
                await asyncio.sleep(0.02)

        async def queued(name: str, priority: int = 0) -> None:
            async for _ in c.generate(
                text=QUESTION, max_tokens=3, temperature=0.0, ignore_eos=True, priority=priority
            ):
                pass
            finished.append(name)

        blockers = [
            c.generate_call(make_request(text=QUESTION, max_tokens=500, ignore_eos=True))
            for _ in range(8)
        ]
        try:
            await until(lambda s: s.num_running == 8)
            waiting = [asyncio.create_task(queued("A"))]
            await until(lambda s: s.num_waiting == 1)
            waiting.append(asyncio.create_task(asyncio.to_thread(through_smg)))
            await until(lambda s: s.num_waiting == 2)
            waiting.append(asyncio.create_task(queued("C", priority=-5)))
            await until(lambda s: s.num_waiting == 3)
            blockers[0].cancel()  # one slot frees: the rest go through it one by one
            await asyncio.gather(*waiting)
        finally:
            for call in blockers:
                call.cancel()
        await until(lambda s: s.num_running == 0)

    async def run() -> None:
        async with TandemClient(target) as c:
            await go(c)

    asyncio.run(run())
    assert finished == ["C", "A", "B"]
