"""Prefill/decode disaggregation and routing, with real processes: a
redis-server, `tandem serve --role prefill|decode` pods over the Redis or
the shared-memory connector, `tandem router` in front, and the session's
colocated server as the reference."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import grpc
import pytest

from service.client import TandemClient, make_request
from service.convert import dict_to_struct
from service.errors import was_refused
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.gateway import SmgGateway, cancel_after, greedy_completions
from tests.integration.redis_server import REDIS_SERVER, RedisServer
from tests.integration.servers import ServerProcess, launched, serving

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6
QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number larger than ten.",
    "What colour is the sky on a clear day?",
    "How many legs does a spider have?",
    "What is two plus two?",
    "Which planet is known as the red planet?",
    "What do bees make?",
    "What is the boiling point of water in Celsius?",
]
PROMPTS = [SYSTEM + q for q in QUESTIONS] + [f"Tell me about the number {i}." for i in range(8)]

# Several servers run at once: small KV caches keep them within memory.
SMALL = ["--kv-cache-memory", "256M", "--max-model-len", "2048"]

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed")


def _kv(connector: str, role: str, extra: Mapping[str, object]) -> list[str]:
    config = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


async def _generate(
    target: str, prompt: str, max_tokens: int | None = 12, **sampling: Any
) -> pb.GenerateResponse:
    """All of one greedy request's chunks merged into one response (EOS
    ignored unless `sampling` says otherwise: on plain text this model often
    ends at once, and then no decode leg would run). `max_tokens` None
    leaves it unset (the server's default)."""
    params: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True, **sampling}
    async with TandemClient(target) as client:
        merged = pb.GenerateResponse()
        async for chunk in client.stub.Generate(
            make_request(text=prompt, max_tokens=max_tokens, **params), timeout=120
        ):
            merged.token_ids.extend(chunk.token_ids)
            merged.text += chunk.text
            merged.logprobs.extend(chunk.logprobs)
            if chunk.finish_reason:
                merged.finish_reason = chunk.finish_reason
                merged.stop_string = chunk.stop_string
                merged.usage.CopyFrom(chunk.usage)
        return merged


async def _generate_all(
    target: str, prompts: list[str], max_tokens: int | None = 12
) -> list[pb.GenerateResponse]:
    return list(await asyncio.gather(*(_generate(target, p, max_tokens) for p in prompts)))


async def _status(target: str) -> pb.ServerStatus:
    async with TandemClient(target) as client:
        return await client.status()


async def _wait_idle(target: str, timeout: float = 30.0) -> pb.ServerStatus:
    """A pod's status once it holds no request and no KV block."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        status = await _status(target)
        idle = not (status.num_running or status.num_waiting or status.kv_cache_usage)
        if idle or asyncio.get_running_loop().time() > deadline:
            return status
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def spare_pod() -> Iterator[ServerProcess]:
    """A colocated pod of its own for the routing test, launched with the
    module's first fixtures so its start-up overlaps theirs."""
    pod = ServerProcess(SMALL)
    with launched(pod):
        yield pod


@pytest.fixture(scope="module")
def reference(server: ServerProcess, spare_pod: ServerProcess) -> list[pb.GenerateResponse]:
    """The colocated server's answers (and the spare pod launched)."""
    return asyncio.run(_generate_all(server.target, PROMPTS))


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed")
    with RedisServer() as srv:
        yield srv


def wait_router_sees_pods(router: str, timeout: float = 60.0) -> None:
    """Until the router's own poll finds every pod healthy: pods and router
    start together, and a router that dialled a pod before it listened
    redials after gRPC's backoff, so it can serve (through the pods it has
    found) while still counting one down, and a first request would take
    the prefill fallback."""
    deadline = time.monotonic() + timeout
    while True:
        status = asyncio.run(_status(router))
        if status.num_pods and status.num_pods_healthy == status.num_pods:
            return
        seen = f"{status.num_pods_healthy} of {status.num_pods}"
        assert time.monotonic() < deadline, f"the router sees {seen} pods healthy"
        time.sleep(0.2)


def _pd_stack(
    producer: list[str],
    consumer: list[str],
    both: tuple[str, ...] = (),
    prefill_cache: list[str] = SMALL,
    decode_cache: list[str] = SMALL,
) -> Iterator[tuple[str, str, str]]:
    prefill = ServerProcess(["--role", "prefill", *prefill_cache, *producer, *both])
    decode = ServerProcess(["--role", "decode", *decode_cache, *consumer, *both])
    router = ServerProcess(
        ["--prefill", prefill.target, "--decode", decode.target, "--poll-seconds", "0.2"],
        command="router",
    )
    with serving(prefill, decode, router):
        wait_router_sees_pods(router.target)
        yield router.target, prefill.target, decode.target


@pytest.fixture(scope="module")
def redis_pd(redis_server: RedisServer) -> Iterator[tuple[str, str, str]]:
    extra = {"url": redis_server.url, "key_prefix": f"t{uuid.uuid4().hex[:6]}:"}
    # Both pods schedule asynchronously: every test over this stack checks
    # outputs equal the colocated (synchronous) server's.
    yield from _pd_stack(
        _kv("redis", "kv_producer", extra), _kv("redis", "kv_consumer", extra), ASYNC
    )


ASYNC = ("--async-scheduling",)


@pytest.fixture(scope="module")
def shm_pd() -> Iterator[tuple[str, str, str]]:
    extra = {"pool_name": f"pd-{uuid.uuid4().hex[:8]}", "capacity_bytes": 256 << 20}
    # Both pods are asked to speculate: the decode pod does, the prefill pod
    # drops it. Every test over this stack checks outputs equal the
    # colocated server's, which does not speculate.
    yield from _pd_stack(
        _kv("shm", "kv_producer", extra), _kv("shm", "kv_consumer", extra), SPECULATE
    )


# Fixed k: the decode pod verifies every draft the lookup finds (adaptive
# drafting, the default, would decide by the pod's own timings).
SPECULATE = (
    "--speculative-config",
    '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}',
)


def _check_parity(got: list[pb.GenerateResponse], want: list[pb.GenerateResponse]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert list(g.token_ids) == list(w.token_ids), f"prompt {i}: {g.text!r} != {w.text!r}"
        assert g.text == w.text
        assert g.finish_reason == w.finish_reason
        assert g.stop_string == w.stop_string
        assert g.usage.prompt_tokens == w.usage.prompt_tokens
        assert g.usage.completion_tokens == w.usage.completion_tokens


@needs_redis
def test_pd_over_redis_matches_colocated(
    redis_pd: tuple[str, str, str],
    redis_server: RedisServer,
    reference: list[pb.GenerateResponse],
) -> None:
    router, prefill, decode = redis_pd
    # The first prompt alone: the decode pod has nothing cached yet, so its
    # cached tokens can only have come through Redis.
    first = asyncio.run(_generate(router, PROMPTS[0]))
    with redis_server.client() as client:
        mgets = client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
    assert mgets > 0, "the decode pod never read from Redis"
    # The decode pod's own counters say the prompt came through the connector
    # (the client's cached_tokens are the prefill pod's hit, as colocated: 0).
    hits = asyncio.run(_status(decode)).kv_connector_hits
    assert hits >= 16 * (first.usage.prompt_tokens // 16 - 1)
    assert first.usage.cached_tokens == 0
    got = asyncio.run(_generate_all(router, PROMPTS))
    _check_parity([first], reference[:1])
    _check_parity(got, reference)
    for target in (prefill, decode):
        status = asyncio.run(_wait_idle(target))
        assert (status.num_running, status.num_waiting) == (0, 0)
        assert status.kv_cache_usage == 0.0


def test_pd_over_shared_memory_matches_colocated(
    shm_pd: tuple[str, str, str], reference: list[pb.GenerateResponse]
) -> None:
    router, prefill, decode = shm_pd
    first = asyncio.run(_generate(router, PROMPTS[0]))
    # The decode pod's own counters say the prompt came through the connector.
    hits = asyncio.run(_status(decode)).kv_connector_hits
    assert hits >= 16 * (first.usage.prompt_tokens // 16 - 1)
    got = asyncio.run(_generate_all(router, PROMPTS))
    _check_parity([first], reference[:1])
    _check_parity(got, reference)
    for target in (prefill, decode):
        status = asyncio.run(_wait_idle(target))
        assert (status.num_running, status.num_waiting, status.kv_cache_usage) == (0, 0, 0.0)
    # The decode pod verified drafts (and accepted some); the prefill pod never drafted.
    spec = asyncio.run(_status(decode)).spec_decoding
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert not asyncio.run(_status(prefill)).HasField("spec_decoding")


def test_pd_usage_equals_colocated(server: ServerProcess, shm_pd: tuple[str, str, str]) -> None:
    """A new prompt, then again: the router reports the usage a colocated
    server does, cached tokens included (the prefill pod's prefix-cache
    hit: none, then the prompt's full blocks), not the decode pod's count
    of the KV it was handed (the whole prompt, both times)."""
    router = shm_pd[0]
    prompt = f"Run {uuid.uuid4().hex[:8]}. {SYSTEM}Name a fruit."
    for run in ("new", "again"):
        want = asyncio.run(_generate(server.target, prompt))
        got = asyncio.run(_generate(router, prompt))
        _check_parity([got], [want])
        assert got.usage.cached_tokens == want.usage.cached_tokens, run
    assert want.usage.cached_tokens > 0  # the second run hit the prefix cache


def test_first_token_comes_from_the_prefill_leg(shm_pd: tuple[str, str, str]) -> None:
    """The router streams the prefill pod's token as its own message, before
    any of the decode leg's."""
    router, _, _ = shm_pd

    async def chunks() -> list[pb.GenerateResponse]:
        async with TandemClient(router) as client:
            call = client.stub.Generate(
                make_request(
                    text=SYSTEM + "Say hello.", max_tokens=8, temperature=0.0, ignore_eos=True
                )
            )
            return [chunk async for chunk in call]

    got = asyncio.run(chunks())
    assert len(got[0].token_ids) == 1 and not got[0].finish_reason
    assert len(got) >= 2 and got[-1].finish_reason
    assert got[-1].usage.completion_tokens == sum(len(c.token_ids) for c in got)


# --- text across the handover ----------------------------------------------------
# The router hands a request from the prefill pod to the decode pod after its
# first token. Text that straddles that point (a stop string the first token
# begins, a character whose UTF-8 bytes the first token only starts) must
# reach the client as a colocated server sends it.

# The greedy continuation is " four", ",", " five", ...: two tokens with text.
COUNTING = "Count: one, two, three,"


def _first_two_texts(server: ServerProcess) -> tuple[str, str]:
    """The text of each of COUNTING's first two greedy tokens (as decoded
    alone, which for this byte-level tokenizer is their text in sequence)."""
    got = asyncio.run(_generate(server.target, COUNTING, max_tokens=2, logprobs=0))
    first, second = (lp.sampled.token for lp in got.logprobs)
    assert first and second and "\ufffd" not in first + second
    return first, second


PD_SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "shades": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["colour", "shades"],
    "additionalProperties": False,
}

COPY = {"name": "Ada", "age": 36, "languages": ["en", "fr"], "active": True}
COPY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_constrained_requests_continue_their_grammar_after_the_handover(
    shm_pd: tuple[str, str, str], server: ServerProcess, reference: list[pb.GenerateResponse]
) -> None:
    """The prefill pod samples the first token under the constraint; the
    decode pod's grammar starts after it: outputs equal the colocated ones,
    and they obey the constraint."""
    router = shm_pd[0]
    prompt = f"Run {uuid.uuid4().hex[:8]}. {SYSTEM}Answer as JSON:"
    cases: list[dict[str, Any]] = [
        {"json_schema": PD_SCHEMA},
        {"regex": r"(ab|cd)[0-9]{3,6}!"},
        {"choice": ["a long answer about colours", "a short one"]},
        {"json_object": True},
        {"grammar": 'root ::= "colour: " ("red" | "green" | "blue") ", " [0-9] [0-9]? "."'},
    ]

    def both(constraint: dict[str, Any]) -> tuple[pb.GenerateResponse, pb.GenerateResponse]:
        # One after the other: four pods' torch threads at once on 2 cores
        # slowed each leg tenfold.
        kw: dict[str, Any] = {"max_tokens": 40, "ignore_eos": False, "constraint": constraint}
        got = asyncio.run(_generate(router, prompt, **kw))
        return got, asyncio.run(_generate(server.target, prompt, **kw))

    texts = []
    for constraint in cases:
        got, want = both(constraint)
        _check_parity([got], [want])
        texts.append(got.text)
        if "json_object" in constraint and got.finish_reason == pb.FINISH_REASON_LENGTH:
            assert got.text.startswith("{")  # an object the limit cut short
            continue
        assert got.finish_reason == pb.FINISH_REASON_STOP, (constraint, got.text)
    parsed = json.loads(texts[0])
    assert parsed["colour"] in ("red", "green", "blue") and 1 <= parsed["shades"] <= 99
    assert re.fullmatch(r"(ab|cd)[0-9]{3,6}!", texts[1])
    assert texts[2] in cases[2]["choice"]
    assert re.fullmatch(r"colour: (red|green|blue), [0-9]{1,2}\.", texts[4])
    # A copy the decode pod's n-gram drafts run through under a schema (the
    # deterministic reproducer of drafts reaching a grammar's end, which once
    # ended the engine, is in tests/e2e/test_spec_decode.py); the pod serves on.
    copy = f"Repeat this JSON exactly: {json.dumps(COPY)}\nJSON: "
    kw: dict[str, Any] = {"max_tokens": 60, "ignore_eos": False}
    got = asyncio.run(_generate(router, copy, constraint={"json_schema": COPY_SCHEMA}, **kw))
    want = asyncio.run(
        _generate(server.target, copy, constraint={"json_schema": COPY_SCHEMA}, **kw)
    )
    _check_parity([got], [want])
    assert json.loads(got.text)["name"] == "Ada"
    _check_parity([asyncio.run(_generate(router, PROMPTS[0]))], reference[:1])
    # One that does not compile: the prefill pod's refusal reaches the client.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_generate(router, prompt, constraint={"regex": "(open"}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in (err.value.details() or "")


def test_stop_string_spanning_the_handover(
    server: ServerProcess, shm_pd: tuple[str, str, str]
) -> None:
    """A stop string that begins in the first token's text and ends in the
    second's: the first token came from the prefill pod and the second from
    the decode pod, yet the request stops there, trimmed, as colocated."""
    router = shm_pd[0]
    first, second = _first_two_texts(server)
    # Begins inside the first token / is exactly the first two tokens.
    for stop in (first[-2:] + second[:1], first + second):
        want = asyncio.run(_generate(server.target, COUNTING, stop=[stop]))
        # The case under test: the colocated server stops at token 2.
        assert (len(want.token_ids), want.stop_string) == (2, stop)
        assert want.text == (first + second)[: (first + second).index(stop)]
        got = asyncio.run(_generate(router, COUNTING, stop=[stop]))
        _check_parity([got], [want])


def test_a_later_stop_string_still_trims_after_the_handover(
    server: ServerProcess, shm_pd: tuple[str, str, str]
) -> None:
    """A stop string met well inside the decode leg's output, and one that
    never matches but whose start is held back at the handover."""
    router = shm_pd[0]
    first, _ = _first_two_texts(server)
    for stop in ([" six"], [first[-1] + "#never"]):
        want = asyncio.run(_generate(server.target, COUNTING, stop=stop))
        got = asyncio.run(_generate(router, COUNTING, stop=stop))
        _check_parity([got], [want])


def test_character_split_at_the_handover(
    server: ServerProcess, shm_pd: tuple[str, str, str]
) -> None:
    """The model continues a run of emoji one byte-level token at a time
    (here each emoji is three tokens), so the prefill leg's single token is
    the first byte of a character: its text must not be lost or garbled."""
    prompt = "\U0001f389" * 8
    want = asyncio.run(_generate(server.target, prompt, max_tokens=6, logprobs=0))
    # The case under test: the first token alone is an incomplete character.
    assert want.logprobs[0].sampled.token.endswith("\ufffd")
    assert "\ufffd" not in want.text
    got = asyncio.run(_generate(shm_pd[0], prompt, max_tokens=6))
    _check_parity([got], [want])


def test_min_tokens_and_default_max_tokens_match_colocated(
    server: ServerProcess, shm_pd: tuple[str, str, str]
) -> None:
    """min_tokens carries over an EOS first token (PROMPTS[0]'s greedy first
    token is EOS: no stop before min_tokens tokens), and an unset max_tokens
    is the default for the whole request, not per leg."""
    router = shm_pd[0]
    cases: list[dict[str, Any]] = [
        {"max_tokens": 6, "min_tokens": 3, "ignore_eos": False},
        {"max_tokens": None},
    ]
    for sampling in cases:
        want = asyncio.run(_generate(server.target, PROMPTS[0], **sampling))
        got = asyncio.run(_generate(router, PROMPTS[0], **sampling))
        _check_parity([got], [want])
    # The min_tokens case ran past the EOS that ends it without min_tokens.
    plain = asyncio.run(_generate(server.target, PROMPTS[0], ignore_eos=False))
    assert len(plain.token_ids) == 1 and plain.finish_reason == pb.FINISH_REASON_STOP


def test_prompts_at_max_model_len_end_with_length_as_colocated(
    shm_pd: tuple[str, str, str],
) -> None:
    """A colocated server generates until max_model_len and ends with
    LENGTH. Through the router, a prompt one short of the pods' limit
    (2048) is answered by the prefill leg alone (a decode leg's prompt
    would not fit), and one two short by both legs."""
    router, prefill, decode = shm_pd

    async def run(prompt_len: int) -> pb.GenerateResponse:
        ids = [100 + i % 1000 for i in range(prompt_len)]
        merged = pb.GenerateResponse()
        async with TandemClient(router) as client:
            request = make_request(token_ids=ids, max_tokens=16, temperature=0.0, ignore_eos=True)
            async for chunk in client.stub.Generate(request, timeout=120):
                merged.token_ids.extend(chunk.token_ids)
                if chunk.finish_reason:
                    merged.finish_reason = chunk.finish_reason
                    merged.usage.CopyFrom(chunk.usage)
        return merged

    for prompt_len, expected in ((2047, 1), (2046, 2)):
        answer = asyncio.run(run(prompt_len))
        assert len(answer.token_ids) == expected, prompt_len
        assert answer.finish_reason == pb.FINISH_REASON_LENGTH
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
            prompt_len,
            expected,
        )
    for target in (prefill, decode):
        status = asyncio.run(_wait_idle(target))
        assert not (status.num_running or status.num_waiting or status.kv_cache_usage)


def test_output_tokens_beyond_the_prompt_are_refused(server: ServerProcess) -> None:
    async def send() -> None:
        request = make_request(token_ids=[5, 6], max_tokens=2)
        request.num_output_tokens_in_prompt = 3
        async with TandemClient(server.target) as client:
            async for _ in client.stub.Generate(request):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(send())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("num_output_tokens_in_prompt: ")
    assert was_refused(err.value)  # nothing of it ran


# When a client cancels at the router: (phase, seconds after sending without
# reading anything, or None: on receiving this many chunks). The first
# chunk is the prefill pod's token; the delays land before it, while the
# prefill leg runs or its answer is on its way.
CANCEL_PHASES: list[tuple[str, float | None, int]] = [
    ("at once", 0.0, 0),
    ("before the first token, 50 ms in", 0.05, 0),
    ("before the first token, 150 ms in", 0.15, 0),
    ("before the first token, 300 ms in", 0.3, 0),
    ("right after the first token", None, 1),
    ("mid-decode", None, 3),
]


async def _cancel(router: str, prompt: str, delay: float | None, chunks: int) -> None:
    async with TandemClient(router) as client:
        call = client.stub.Generate(
            make_request(text=prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        )
        if delay is not None:
            await asyncio.sleep(delay)
            call.cancel()
            return
        seen = 0
        async for _ in call:
            seen += 1
            if seen >= chunks:
                call.cancel()
                return


def cancel_at_every_phase(router: str, pods: list[str], prompt: str, within: float) -> None:
    """Cancels one request at the router at each of CANCEL_PHASES; after
    each, every pod holds no request and no KV block within `within`
    seconds (a step or two, on a loaded machine)."""
    for i, (phase, delay, chunks) in enumerate(CANCEL_PHASES):
        asyncio.run(_cancel(router, f"Case {i}. {prompt}", delay, chunks))
        for target in pods:
            status = asyncio.run(_wait_idle(target, timeout=within))
            held = (status.num_running, status.num_waiting, status.kv_cache_usage)
            assert held == (0, 0, 0.0), f"cancelled {phase}: {target} still holds {held}"


def test_client_cancel_at_the_router_frees_both_pods(shm_pd: tuple[str, str, str]) -> None:
    """The shm connector copies blocks out as they are computed: the prefill
    pod holds nothing for the decode leg, whenever the client cancels."""
    router, prefill, decode = shm_pd
    cancel_at_every_phase(router, [prefill, decode], SYSTEM + "Count to one hundred.", 10.0)


def check_pd_behind_smg(
    prefill: str,
    decode: str,
    prompts: list[str],
    reference: list[pb.GenerateResponse],
    fresh_prompt: str,
    cancel_prompt: str,
    *,
    partial_blocks: bool = False,
    cancels: tuple[int, ...] = (0, 1, 3),
    within: float = 10.0,
) -> None:
    """smg in P/D mode in front of the pods: its prefill leg (max_tokens 1,
    no kv_transfer_params) makes the prefill pod hand the KV over, and the
    params it relays to the decode leg load it. Greedy text is the
    colocated server's; cancels after each of `cancels` chunks leave both
    pods idle within `within` seconds."""
    with SmgGateway(prefill=[prefill], decode=[decode]) as gateway:
        client = gateway.openai(timeout=120.0)
        # A prompt no pod has seen: the KV the decode pod did not compute
        # came through the connector: every prompt token but the last (the
        # decode pod computes it for its first token), in whole blocks
        # unless the connector moves partial ones.
        before = asyncio.run(_status(decode)).kv_connector_hits
        (fresh,) = greedy_completions(client, [fresh_prompt])
        loaded = asyncio.run(_status(decode)).kv_connector_hits - before
        assert fresh.usage is not None
        computed_before = fresh.usage.prompt_tokens - 1
        assert loaded == (computed_before if partial_blocks else 16 * (computed_before // 16))
        got = greedy_completions(client, prompts)
        for i, (g, want) in enumerate(zip(got, reference, strict=True)):
            assert g.choices[0].text == want.text, f"prompt {i}"
            assert g.usage is not None
            assert g.usage.completion_tokens == want.usage.completion_tokens
            assert g.usage.prompt_tokens == want.usage.prompt_tokens
        for chunks in cancels:
            cancel_after(client, f"Case {chunks}. {cancel_prompt}", chunks)
            for target in (prefill, decode):
                status = asyncio.run(_wait_idle(target, timeout=within))
                held = (status.num_running, status.num_waiting, status.kv_cache_usage)
                assert held == (0, 0, 0.0), f"after {chunks} chunks: {target} holds {held}"


def test_pd_over_shared_memory_behind_smg(
    shm_pd: tuple[str, str, str], reference: list[pb.GenerateResponse]
) -> None:
    _, prefill, decode = shm_pd
    # The router's cancel test covers every phase on these pods; one here.
    check_pd_behind_smg(
        prefill,
        decode,
        PROMPTS[::2],
        reference[::2],
        f"Run {uuid.uuid4().hex[:8]}. {SYSTEM}Name a colour.",
        SYSTEM + "Count to one hundred.",
        cancels=(1,),
    )


def test_router_passes_pod_errors_through(shm_pd: tuple[str, str, str]) -> None:
    router = shm_pd[0]

    async def bad() -> None:
        async with TandemClient(router) as client:
            async for _ in client.stub.Generate(
                make_request(text="hi", max_tokens=4, temperature=-1.0)
            ):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(bad())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details.startswith("prefill pod: sampling.temperature: "), details
    # The pods' addresses are the router's business, not its clients'.
    for target in shm_pd:
        assert target.rpartition(":")[2] not in details, details
    assert was_refused(err.value)  # the prefill pod refused: nothing ran anywhere


def test_a_pod_drained_with_a_short_grace_never_answers_ok_with_abort(
    server: ServerProcess,
) -> None:
    """SIGTERM to a pod with --drain-grace 0.3 while the router streams
    requests from it: those the drain aborts end UNAVAILABLE (the pod's
    own abort, not the client's), the rest are the colocated answers;
    none comes back OK with finish reason ABORT."""
    pod = ServerProcess([*SMALL, "--drain-grace", "0.3"])
    router = ServerProcess(["--decode", pod.target, "--poll-seconds", "0.2"], command="router")
    prompts = [f"Case {i}. {SYSTEM}Count to fifty." for i in range(6)]
    with serving(pod, router):
        wait_router_sees_pods(router.target)
        want = asyncio.run(_generate_all(server.target, prompts, max_tokens=40))
        got = asyncio.run(_drained_mid_run(router.target, prompts, pod))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(g, grpc.aio.AioRpcError):
            assert g.code() == grpc.StatusCode.UNAVAILABLE, (i, g.details())
        else:
            assert g.finish_reason != pb.FINISH_REASON_ABORT, f"prompt {i}: OK with ABORT"
            _check_parity([g], [w])
    cut = [g for g in got if isinstance(g, grpc.aio.AioRpcError)]
    assert cut, "the drain aborted nothing: the case under test did not happen"


async def _drained_mid_run(
    router: str, prompts: list[str], pod: ServerProcess
) -> list[pb.GenerateResponse | grpc.aio.AioRpcError]:
    """`prompts` through the router (40 greedy tokens each); `pod` is sent
    SIGTERM once the first token has reached a client."""
    started = asyncio.Event()

    async def one(prompt: str) -> pb.GenerateResponse | grpc.aio.AioRpcError:
        merged = pb.GenerateResponse()
        request = make_request(text=prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        try:
            async with TandemClient(router) as client:
                async for chunk in client.stub.Generate(request, timeout=120):
                    started.set()
                    merged.token_ids.extend(chunk.token_ids)
                    merged.text += chunk.text
                    if chunk.finish_reason:
                        merged.finish_reason = chunk.finish_reason
                        merged.usage.CopyFrom(chunk.usage)
        except grpc.aio.AioRpcError as e:
            return e
        return merged

    calls = [asyncio.create_task(one(p)) for p in prompts]
    await asyncio.wait_for(started.wait(), 120)
    pod.signal_drain()
    return list(await asyncio.gather(*calls))


def test_prefix_aware_routing_between_colocated_pods(
    server: ServerProcess, spare_pod: ServerProcess
) -> None:
    """Two idle colocated pods behind a router: A (the session's server,
    which a load-only tie-break picks first) and B, which computed a long
    prefix. Requests sharing it, sent to the router, all land on B."""
    b = spare_pod
    router = ServerProcess(
        ["--decode", f"{server.target},{b.target}", "--poll-seconds", "0.2"], command="router"
    )
    with b, serving(router):
        prefix = "Here is a long shared preamble about routing requests. " * 12

        async def run() -> tuple[int, pb.ServerStatus, pb.ServerStatus]:
            a_before = (await _status(server.target)).prefix_cache_queries
            await _generate(b.target, prefix + "First question?", max_tokens=4)
            before = await _status(b.target)
            await asyncio.sleep(1.0)  # the router follows B's KV events
            for i in range(4):
                await _generate(router.target, prefix + f"Question {i}?", max_tokens=4)
            a_queries = (await _status(server.target)).prefix_cache_queries - a_before
            return a_queries, before, await _status(b.target)

        a_queries, b_before, b_after = asyncio.run(run())
        assert a_queries == 0, "a request went to pod A"
        assert b_after.prefix_cache_hits > b_before.prefix_cache_hits


async def _leg(
    target: str, token_ids: list[int], max_tokens: int, params: dict[str, Any]
) -> pb.GenerateResponse:
    """One leg sent straight to a pod (as the router would), merged."""
    async with TandemClient(target) as client:
        request = make_request(
            token_ids=token_ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        request.kv_transfer_params.CopyFrom(dict_to_struct(params))
        merged = pb.GenerateResponse()
        async for chunk in client.stub.Generate(request, timeout=120):
            merged.token_ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                merged.usage.CopyFrom(chunk.usage)
                merged.kv_transfer_params.CopyFrom(chunk.kv_transfer_params)
        return merged


@needs_redis
def test_pd_faults_over_redis(
    redis_server: RedisServer, server: ServerProcess, reference: list[pb.GenerateResponse]
) -> None:
    """A prefill pod killed after answering, a decode pod that never pulls,
    and Redis gone mid-run: outputs stay those of the colocated server, and
    no pod is left holding requests or blocks."""
    extra = {"url": redis_server.url, "key_prefix": f"f{uuid.uuid4().hex[:6]}:"}
    # Not a `with`: this prefill pod is killed, not drained.
    pre = ServerProcess(["--role", "prefill", *SMALL, *_kv("redis", "kv_producer", extra)])
    # Blocks that never come are given up on after 2 s (not the default 10).
    consumer = _kv("redis", "kv_consumer", {**extra, "load_wait_seconds": 2})
    # Asynchronous scheduling: lost loads rewind requests with a step in flight.
    dec = ServerProcess(["--role", "decode", *SMALL, *consumer, *ASYNC])
    with launched(pre), dec:  # both start at once
        pre.wait_started()
        _faults(pre, dec, redis_server, server, reference, extra)


def _faults(
    pre: ServerProcess,
    dec: ServerProcess,
    redis_server: RedisServer,
    server: ServerProcess,
    reference: list[pb.GenerateResponse],
    extra: dict[str, str],
) -> None:
    ids = asyncio.run(_tokenize(server.target, PROMPTS[1]))
    # The prefill answers, then dies (SIGKILL): its blocks are in Redis.
    first = asyncio.run(_leg(pre.target, ids, 1, {"do_remote_decode": True}))
    params = json.loads(json.dumps(dict(first.kv_transfer_params)))
    assert params["do_remote_prefill"] is True
    # A decode that never pulls: the prefill pod holds nothing meanwhile.
    status = asyncio.run(_wait_idle(pre.target))
    assert (status.num_running, status.num_waiting, status.kv_cache_usage) == (0, 0, 0.0)
    # Killed once its saves landed (a kill before that is the Redis-gone
    # case below: the decode pod recomputes what is missing).
    _wait_for_keys(redis_server, extra["key_prefix"], len(ids) // 16)
    pre.kill()
    rest = asyncio.run(_leg(dec.target, ids + list(first.token_ids), 11, params))
    assert list(first.token_ids) + list(rest.token_ids) == list(reference[1].token_ids)
    assert rest.usage.cached_tokens >= 16 * (len(ids) // 16 - 1)
    # Redis gone: the same request again (the decode pod now has its
    # blocks cached), and one whose blocks only Redis was to supply
    # (beyond the system prompt's): that load fails and it recomputes.
    before = asyncio.run(_status(dec.target))
    ids2 = asyncio.run(_tokenize(server.target, PROMPTS[2]))
    want2 = list(reference[2].token_ids)
    params2 = {"do_remote_prefill": True, "num_blocks": len(ids2) // 16}
    redis_server.kill()
    try:
        again = asyncio.run(_leg(dec.target, ids + list(first.token_ids), 11, params))
        other = asyncio.run(_leg(dec.target, ids2 + want2[:1], 11, params2))
    finally:
        redis_server.start()
    assert list(again.token_ids) == list(rest.token_ids)
    assert want2[:1] + list(other.token_ids) == want2
    status = asyncio.run(_wait_idle(dec.target))
    assert (status.num_running, status.num_waiting, status.kv_cache_usage) == (0, 0, 0.0)
    # The decode pod counts what it recomputed, and why.
    assert status.kv_recomputed_tokens > before.kv_recomputed_tokens
    failures = status.kv_transfer_failures
    assert failures["store_error"] == before.kv_transfer_failures.get("store_error", 0) + 1


async def _tokenize(target: str, text: str) -> list[int]:
    async with TandemClient(target) as client:
        return await client.tokenize(text)


def _wait_for_keys(redis_server: RedisServer, prefix: str, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    with redis_server.client() as client:
        while len(client.keys(f"{prefix}*")) < count:
            assert time.monotonic() < deadline, f"fewer than {count} blocks saved to Redis"
            time.sleep(0.05)


@needs_redis
def test_fail_policy_ends_a_failed_load_with_unavailable(
    redis_server: RedisServer, server: ServerProcess
) -> None:
    """--kv-load-failure-policy fail: a decode leg whose blocks never arrive
    ends with UNAVAILABLE (retryable) instead of recomputing, and the pod
    keeps nothing."""
    extra = {"url": redis_server.url, "key_prefix": "absent:", "load_wait_seconds": 0.5}
    args = ["--role", "decode", *SMALL, *_kv("redis", "kv_consumer", extra)]
    with ServerProcess([*args, "--kv-load-failure-policy", "fail"]) as dec:
        ids = asyncio.run(_tokenize(server.target, PROMPTS[2]))
        params = {"do_remote_prefill": True, "num_blocks": len(ids) // 16}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(_leg(dec.target, ids, 4, params))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "KV load failed" in (err.value.details() or "")
        status = asyncio.run(_wait_idle(dec.target))
        assert (status.num_running, status.num_waiting, status.kv_cache_usage) == (0, 0, 0.0)


def test_router_forwards_tokenize_and_model_info(shm_pd: tuple[str, str, str]) -> None:
    router, _, decode = shm_pd

    async def ask() -> tuple[pb.ModelInfo, list[int], list[int], str, str]:
        async with TandemClient(router) as via_router, TandemClient(decode) as direct:
            info = await via_router.model_info()
            return (
                info,
                await via_router.tokenize("Hello there"),
                await direct.tokenize("Hello there"),
                (await direct.model_info()).weight_format,
                (await via_router.status()).weight_format,
            )

    info, routed, direct, pod_format, status_format = asyncio.run(ask())
    assert info.role == "router" and info.model_name
    assert routed == direct and routed
    # Both pods load the same model alike: their one format, as a pod says it.
    assert pod_format and info.weight_format == status_format == pod_format


def test_router_resolves_pool_names_into_pods(server: ServerProcess) -> None:
    """A pool address with a DNS name (a headless Service in Kubernetes;
    localhost here) stands for the pods it resolves to; a name resolving to
    nothing only adds no pod."""
    port = server.target.rpartition(":")[2]
    decode = f"localhost:{port},tandem-nowhere.invalid:{port}"
    with ServerProcess(["--decode", decode, "--poll-seconds", "0.2"], command="router") as router:
        got = asyncio.run(_generate(router.target, PROMPTS[0]))
        log = router.log()
    _check_parity([got], [asyncio.run(_generate(server.target, PROMPTS[0]))])
    assert f"added (localhost:{port})" in log
    assert f"tandem-nowhere.invalid:{port} resolves to no address" in log


# --- a client reusing another's request_id (over NIXL: the prefill pod holds KV) -------

needs_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl_cu12") is None, reason="nixl-cu12 not installed"
)
VICTIM = "Victim question: what is the tallest mountain on Earth, and where is it?"
# Prompts the prefill pod serves meanwhile: with its 24M cache they take the
# blocks a released hold would have left free.
OTHERS = [f"Other {i}: " + "a long story about a red fox and a brown dog. " * 13 for i in range(4)]
FILLER = "Filler: " + SYSTEM + "Count from one to one thousand."


@pytest.fixture(scope="module")
def nixl_busy_decode(
    nixl_tiny_prefill: ServerProcess, nixl_busy_decode_pod: ServerProcess
) -> Iterator[tuple[str, str, str]]:
    """Router, NIXL prefill pod (a small cache) and a decode pod that runs
    one request at a time: a second decode leg waits in its queue while
    the prefill pod holds that leg's KV. Both pods are the session's
    (tests/integration/conftest.py: test_nixl_holds and test_pd_preemption
    use them too); the router is this module's."""
    prefill, decode = nixl_tiny_prefill, nixl_busy_decode_pod
    router = ServerProcess(
        ["--prefill", prefill.target, "--decode", decode.target, "--poll-seconds", "0.2"],
        command="router",
    )
    with serving(router):
        prefill.wait_started()
        decode.wait_started()
        wait_router_sees_pods(router.target)
        yield router.target, prefill.target, decode.target


async def _held_leg(target: str, request_id: str, token_ids: list[int]) -> pb.GenerateResponse:
    """A prefill leg sent straight to `target` under `request_id` (its KV
    then held for a decode leg), merged."""
    request = make_request(
        token_ids=token_ids, max_tokens=1, temperature=0.0, request_id=request_id
    )
    request.kv_transfer_params.CopyFrom(dict_to_struct({"do_remote_decode": True}))
    merged = pb.GenerateResponse()
    async with TandemClient(target) as client:
        async for chunk in client.stub.Generate(request, timeout=120):
            merged.MergeFrom(chunk)
    return merged


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.1)


@needs_nixl
def test_a_prefill_pods_refusal_of_a_held_id_is_marked_refused(
    nixl_busy_decode: tuple[str, str, str],
) -> None:
    """An id the prefill pod's scheduler still holds (a finished prefill
    leg's, its KV kept for a decode pod): a second request under it is
    refused, marked refused, and the hold is left alone."""
    prefill = nixl_busy_decode[1]

    async def go() -> tuple[grpc.aio.AioRpcError, int]:
        ids = await _tokenize(prefill, VICTIM)
        await _held_leg(prefill, "held-id", ids)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _held_leg(prefill, "held-id", ids)
        held = (await _status(prefill)).kv_held_requests
        async with TandemClient(prefill) as client:  # releases it
            await client.stub.Abort(pb.AbortRequest(request_ids=["held-id"]))
        return err.value, held

    error, held = asyncio.run(go())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in use by a finished request" in (error.details() or "")
    assert was_refused(error)
    assert held == 1
    status = asyncio.run(_wait_idle(prefill))
    assert (status.kv_held_requests, status.kv_cache_usage) == (0, 0.0)


@needs_nixl
def test_a_reused_request_id_never_releases_the_victims_hold(
    server: ServerProcess, nixl_busy_decode: tuple[str, str, str]
) -> None:
    """The victim's decode leg waits behind a filler while the prefill pod
    holds its KV; a second client sends the victim's request_id through the
    router, and the prefill pod then serves other prompts. The hold stays
    (the duplicate names no leg of the victim's), and the victim's answer
    is the colocated one, read over NIXL, nothing recomputed."""
    router, prefill, decode = nixl_busy_decode
    want = asyncio.run(_generate(server.target, VICTIM))

    async def go() -> tuple[pb.GenerateResponse, grpc.aio.AioRpcError | None, int]:
        recomputed = (await _status(decode)).kv_recomputed_tokens
        filler = asyncio.create_task(_generate(router, FILLER, max_tokens=400))
        await _until(lambda: _running(decode, 1, 0), "the filler decodes")
        victim = asyncio.create_task(_generate(router, VICTIM, request_id="victim"))
        await _until(lambda: _running(decode, 1, 1), "the victim's decode leg waits")
        await _until(lambda: _holds(prefill, 1), "the prefill pod holds the victim's KV")
        duplicate: grpc.aio.AioRpcError | None = None
        try:
            await _generate(router, "Another question.", request_id="victim")
        except grpc.aio.AioRpcError as e:
            duplicate = e
        await asyncio.sleep(1.0)  # a release, had one been sent, lands meanwhile
        for prompt in OTHERS:
            await _generate(prefill, prompt, max_tokens=1)
        held = (await _status(prefill)).kv_held_requests
        assert held == 1, "the prefill pod released the victim's hold"
        filler.cancel()
        got = await victim
        return got, duplicate, (await _status(decode)).kv_recomputed_tokens - recomputed

    got, duplicate, recomputed = asyncio.run(go())
    _check_parity([got], [want])
    assert recomputed == 0
    # The duplicate was refused as a colocated server refuses a live id.
    assert duplicate is not None and duplicate.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert duplicate.details() == "request_id: 'victim' is already in use by a live request"
    assert was_refused(duplicate)


async def _running(target: str, running: int, waiting: int) -> bool:
    status = await _status(target)
    return (status.num_running, status.num_waiting) == (running, waiting)


async def _holds(target: str, count: int) -> bool:
    return (await _status(target)).kv_held_requests == count
