"""Prefill/decode disaggregation over NixlConnector, with real processes:
`tandem serve --role prefill|decode` pods whose NIXL agents (UCX over host
memory) READ KV blocks from each other, `tandem router` in front, and the
session's colocated server as the reference."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from connectors.nixl_handshake import fetch_peer_info
from service.client import TandemClient, make_request
from service.convert import struct_to_dict
from service.errors import was_refused
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.servers import ServerProcess, launched, serving
from tests.integration.test_pd import (
    PROMPTS,
    SMALL,
    SYSTEM,
    _check_parity,
    _generate,
    _generate_all,
    _kv,
    _leg,
    _status,
    _tokenize,
    _wait_idle,
    cancel_at_every_phase,
    check_pd_behind_smg,
    wait_router_sees_pods,
)

pytest.importorskip("nixl_cu12", reason="nixl-cu12 not installed")

Stack = tuple[ServerProcess, ServerProcess, ServerProcess]  # router, prefill, decode
PRODUCER = _kv("nixl", "kv_producer", {})
CONSUMER = _kv("nixl", "kv_consumer", {})
# The decode pods get a smaller cache than the prefill pods: peers with
# different block counts must still find each other's blocks.
DECODE_SMALL = ["--kv-cache-memory", "192M", "--max-model-len", "2048"]
# A short lease, so the never-read test need not wait 30 s; the decode pod's
# heartbeats (every second) keep every hold it means to read.
LEASE = ["--kv-lease-seconds", "3"]


def _idle(target: str) -> None:
    status = asyncio.run(_wait_idle(target))
    assert (status.num_running, status.num_waiting, status.kv_cache_usage) == (0, 0, 0.0)


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> list[pb.GenerateResponse]:
    return asyncio.run(_generate_all(server.target, PROMPTS))


def _nixl_stack(prefill_args: list[str], decode_args: list[str]) -> Iterator[Stack]:
    """Router, prefill pod and decode pod (NIXL producer and consumer)."""
    prefill = ServerProcess(["--role", "prefill", *prefill_args, *PRODUCER])
    decode = ServerProcess(["--role", "decode", *decode_args, *CONSUMER], metrics=True)
    router = ServerProcess(
        ["--prefill", prefill.target, "--decode", decode.target, "--poll-seconds", "0.2"],
        command="router",
    )
    with serving(prefill, decode, router):
        wait_router_sees_pods(router.target)
        yield router, prefill, decode


@pytest.fixture(scope="module")
def nixl_pd() -> Iterator[Stack]:
    yield from _nixl_stack([*SMALL, *LEASE], DECODE_SMALL)


def test_pd_over_nixl_matches_colocated(
    nixl_pd: Stack, reference: list[pb.GenerateResponse]
) -> None:
    router, prefill, decode = (p.target for p in nixl_pd)
    first = asyncio.run(_generate(router, PROMPTS[0]))
    # The decode pod computed only the token the prefill pod sampled: every
    # prompt token's KV came over NIXL. (The client's cached_tokens are the
    # prefill pod's prefix-cache hit, as a colocated server's: none.)
    assert first.usage.cached_tokens == 0
    assert asyncio.run(_status(decode)).kv_connector_hits == first.usage.prompt_tokens
    got = asyncio.run(_generate_all(router, PROMPTS))
    _check_parity([first], reference[:1])
    _check_parity(got, reference)
    # Every hold was released by the READ's notification (the lease is 30 s).
    _idle(prefill)
    _idle(decode)


def _prefill_leg(target: str, ids: list[int]) -> tuple[list[int], dict[str, Any]]:
    """The router's first leg, sent straight to a prefill pod: (its one
    token, the kv_transfer_params for the decode leg)."""
    first = asyncio.run(_leg(target, ids, 1, {"do_remote_decode": True}))
    params = struct_to_dict(first.kv_transfer_params)
    assert params["do_remote_prefill"] is True and params["kv_connector"] == "nixl"
    return list(first.token_ids), params


def _decode_leg(
    target: str, ids: list[int], first: list[int], params: dict[str, Any]
) -> pb.GenerateResponse:
    return asyncio.run(_leg(target, ids + first, 11, params))


def _handshakes(proc: ServerProcess, address: str) -> int:
    assert proc.log_path is not None
    log = proc.log_path.read_text(errors="replace")
    return len(re.findall(rf"NIXL handshake with {re.escape(address)} done", log))


# Prompts no pod has seen: the stack's decode pod has PROMPTS cached, and a
# local prefix hit would leave nothing to read. They differ from the first
# block on, so no block hash is shared.
FRESH = [
    f"Note {i}. " + "A long preamble about serving language models in two pools. " * 5 + q
    for i, q in enumerate(["Why split prefill?", "What is a lease?", "Who frees?", "Why?"])
]


def _want(server: ServerProcess, prompt: str) -> tuple[list[int], list[int]]:
    """(prompt ids, the colocated server's 12 greedy tokens)."""
    ids = asyncio.run(_tokenize(server.target, prompt))
    return ids, list(asyncio.run(_generate(server.target, prompt)).token_ids)


def test_prefill_frees_blocks_nobody_reads(nixl_pd: Stack) -> None:
    """A decode pod that never reads: the prefill pod holds the blocks for
    the lease (3 s in this stack), then frees them."""
    prefill = nixl_pd[1].target
    ids = asyncio.run(_tokenize(prefill, FRESH[0]))
    lapsed_before = asyncio.run(_status(prefill)).kv_leases_lapsed
    _, params = _prefill_leg(prefill, ids)
    assert len(params["remote_block_ids"]) == -(-len(ids) // 16)
    held = asyncio.run(_status(prefill))
    assert held.kv_cache_usage > 0, "the prefill pod let the blocks go at once"
    assert held.kv_held_requests == 1
    start = time.monotonic()
    _idle(prefill)
    assert time.monotonic() - start < 20
    # Counted where it happened: the prefill pod freed a hold unread.
    after = asyncio.run(_status(prefill))
    assert after.kv_leases_lapsed == lapsed_before + 1 and after.kv_held_requests == 0


@dataclass(frozen=True)
class LonePrefills:
    """Pods of their own for the tests that mismatch or restart them (see `lone_prefills`)."""

    mismatched: ServerProcess  # 32-token blocks
    # test_restarted_peers_are_handshaken_again's fresh pair
    fresh_decode: ServerProcess
    fresh_prefill: ServerProcess


@pytest.fixture(scope="module")
def lone_prefills() -> Iterator[LonePrefills]:
    """Launched together, so their start-ups overlap (with each other and
    with the tests before the last of them)."""
    pods = LonePrefills(
        mismatched=ServerProcess(["--role", "prefill", *SMALL, "--block-size", "32", *PRODUCER]),
        fresh_decode=ServerProcess(["--role", "decode", *DECODE_SMALL, *CONSUMER]),
        fresh_prefill=ServerProcess(["--role", "prefill", *SMALL, *PRODUCER]),
    )
    with launched(pods.mismatched, pods.fresh_decode, pods.fresh_prefill):
        yield pods


def test_mismatched_block_size_is_refused(
    server: ServerProcess, nixl_pd: Stack, lone_prefills: LonePrefills
) -> None:
    """A prefill pod with 32-token blocks and a decode pod with 16: the
    handshake refuses, naming the difference, and the decode pod recomputes;
    its refusal frees the prefill pod's blocks at once."""
    decode = nixl_pd[2].target
    ids, want = _want(server, FRESH[2])
    before = asyncio.run(_status(decode)).kv_transfer_failures.get("peer_incompatible", 0)
    with lone_prefills.mismatched as pre:
        first, params = _prefill_leg(pre.target, ids)
        rest = _decode_leg(decode, ids, first, params)
        assert first + list(rest.token_ids) == want
        assert rest.usage.cached_tokens == 0
        assert "incompatible KV cache: block_size: peer 32, here 16" in nixl_pd[2].log()
        _idle(decode)
        after = asyncio.run(_status(decode)).kv_transfer_failures.get("peer_incompatible", 0)
        assert after == before + 1
        _idle(pre.target)


def test_restarted_peers_are_handshaken_again(
    server: ServerProcess, nixl_pd: Stack, lone_prefills: LonePrefills
) -> None:
    """A decode pod restarted (a new process handshakes afresh) and a
    prefill pod restarted on the same address (a new incarnation: the decode
    pod's cached entry is stale and is fetched again)."""
    prefill = nixl_pd[1].target
    ids, want = _want(server, FRESH[3])
    pre = lone_prefills.fresh_prefill  # used from the second part on
    with lone_prefills.fresh_decode as dec:
        first, params = _prefill_leg(prefill, ids)
        rest = _decode_leg(dec.target, ids, first, params)
        assert first + list(rest.token_ids) == want
        assert rest.usage.cached_tokens == len(ids)
        assert _handshakes(dec, prefill) == 1
        with pre:
            # PROMPTS[6]: this decode pod has not seen it.
            ids = asyncio.run(_tokenize(server.target, PROMPTS[6]))
            first, params = _prefill_leg(pre.target, ids)
            _decode_leg(dec.target, ids, first, params)
        again = ServerProcess(["--role", "prefill", *SMALL, *PRODUCER])
        again.port, again.target = pre.port, pre.target
        with again:
            ids, want = _want(server, PROMPTS[7])
            first, params2 = _prefill_leg(again.target, ids)
            assert params2["remote_agent"] != params["remote_agent"]
            rest = _decode_leg(dec.target, ids, first, params2)
            assert first + list(rest.token_ids) == want
            assert rest.usage.cached_tokens == len(ids)
            assert _handshakes(dec, pre.target) == 2
            _idle(again.target)


# --- a prefill pod drained mid-run ----------------------------------------------------
# Twenty requests sharing SYSTEM's first four blocks, none a whole number of
# blocks long. The decode pod has those blocks cached, so it READs only each
# prompt's tail. Before the fix the drain did not wait for those READs; each
# failed one cut the request back past what the connector had supplied, its
# hit count went negative, the Prometheus update raised, and that step's
# tokens were lost for every request in it: answers OK but a token short.
DRAIN_PROMPTS = [SYSTEM + f"Question {i}: what is {i} plus {i + 3}?" for i in range(20)]
HELD_PROMPT = SYSTEM + "Question 20: what is 20 plus 23?"


async def _generate_each(target: str, prompts: list[str]) -> list[pb.GenerateResponse]:
    return list(await asyncio.gather(*(_generate(target, p, max_tokens=32) for p in prompts)))


async def _burst(
    target: str, prompts: list[str], on_first_token: Callable[[], None]
) -> list[pb.GenerateResponse | grpc.aio.AioRpcError]:
    """Every prompt at once (greedy, 32 tokens), each merged into one
    response or its error; `on_first_token()` runs once, as soon as any
    request's first token reaches the client."""
    fired: list[bool] = []

    async def one(client: TandemClient, prompt: str) -> pb.GenerateResponse:
        request = make_request(text=prompt, max_tokens=32, temperature=0.0, ignore_eos=True)
        merged = pb.GenerateResponse()
        async for chunk in client.stub.Generate(request, timeout=120):
            if not fired:
                fired.append(True)
                on_first_token()
            merged.token_ids.extend(chunk.token_ids)
            merged.text += chunk.text
            if chunk.finish_reason:
                merged.finish_reason = chunk.finish_reason
                merged.usage.CopyFrom(chunk.usage)
        return merged

    async with TandemClient(target) as client:
        got = await asyncio.gather(*(one(client, p) for p in prompts), return_exceptions=True)
    for answer in got:
        if not isinstance(answer, pb.GenerateResponse | grpc.aio.AioRpcError):
            raise answer
    return got


def _prometheus(proc: ServerProcess, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics").read()
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in the metrics")


def _refused_while_draining(target: str) -> bool:
    try:
        asyncio.run(_generate(target, "Hello", max_tokens=2))
    except grpc.aio.AioRpcError as e:
        return bool(e.code() == grpc.StatusCode.UNAVAILABLE)
    return False


def _health(proc: ServerProcess) -> int | None:
    """The pod's health, asked a few times (one check may time out on a
    busy machine)."""
    for _ in range(5):
        status = proc.health()
        if status is not None:
            return status
    return None


def test_a_prefill_drain_waits_for_the_reads(server: ServerProcess, nixl_pd: Stack) -> None:
    """SIGTERM on the prefill pod as the first token reaches the client:
    every answer is the colocated one or an explicit error, never OK with
    other text. The drain waits for the decode pod to READ what the pod
    holds (here also a prefill leg whose decode leg is sent only once the
    burst is over), refusing new requests and NOT_SERVING meanwhile, its
    side channel still answering; so the decode pod recomputes nothing, and
    it ends idle, its counters agreeing."""
    decode = nixl_pd[2]
    # Lease and grace well past the burst's length on a busy machine: only
    # the decode pod's READ should end the drain.
    patient = ["--kv-lease-seconds", "300", "--drain-grace", "300"]
    pre = ServerProcess(["--role", "prefill", *SMALL, *patient, *PRODUCER])
    router = ServerProcess(
        ["--prefill", pre.target, "--decode", decode.target, "--poll-seconds", "0.2"],
        command="router",
    )
    with launched(pre, router):  # their start-ups overlap the colocated answers
        held_ids, held_want = _want(server, HELD_PROMPT)
        want = asyncio.run(_generate_each(server.target, DRAIN_PROMPTS))
        # The case under test: no prompt fills its last block.
        assert all(w.usage.prompt_tokens % 16 for w in want) and len(held_ids) % 16
        before = asyncio.run(_status(decode.target))
        with pre, router:  # as `serving(pre, router)`: waits for both, drains both
            first, params = _prefill_leg(pre.target, held_ids)  # held: nobody reads it yet
            got = asyncio.run(_burst(router.target, DRAIN_PROMPTS, pre.signal_drain))
            pairs = zip(got, want, strict=True)
            answered = [(g, w) for g, w in pairs if isinstance(g, pb.GenerateResponse)]
            assert answered, f"every request failed: {got}"
            _check_parity([g for g, _ in answered], [w for _, w in answered])
            assert pre.proc is not None and pre.proc.poll() is None, "the drain did not wait"
            assert _health(pre) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert _refused_while_draining(pre.target)
            assert fetch_peer_info(pre.target, 30).agent_name == params["remote_agent"]
            rest = _decode_leg(decode.target, held_ids, first, params)
            assert pre.proc.wait(timeout=120) == 0
    assert first + list(rest.token_ids) == held_want
    assert rest.usage.cached_tokens == len(held_ids)  # read, not recomputed
    after = asyncio.run(_wait_idle(decode.target))
    assert (after.num_running, after.num_waiting, after.kv_cache_usage) == (0, 0, 0.0)
    assert after.kv_recomputed_tokens == before.kv_recomputed_tokens
    assert dict(after.kv_transfer_failures) == dict(before.kv_transfer_failures)
    assert after.kv_connector_hits == _prometheus(decode, "tandem_kv_connector_hits_total")
    assert after.metrics_errors == 0


# --- holds nobody will read --------------------------------------------------------
# The lease (30 s by default) is the last resort for a decode side that went
# away. When the router knows no decode pod will read a prefill pod's blocks
# (the decode leg was refused before any engine saw it, or the first token
# ended the request), it says so and the prefill pod frees them at once.

# The decode pod of this stack refuses prompts the prefill pod takes.
SHORT_DECODE = ["--kv-cache-memory", "192M", "--max-model-len", "64"]
LONG = "Refused. " + "A long preamble about serving language models in two pools. " * 8


@pytest.fixture(scope="module")
def nixl_short_decode() -> Iterator[Stack]:
    """Prefill pod with the default 30 s lease; decode pod with max-model-len
    64. The module's last test kills the prefill pod."""
    yield from _nixl_stack(SMALL, SHORT_DECODE)


def _freed_within(target: str, seconds: float) -> bool:
    """Whether the pod holds no request and no block within `seconds`."""
    status = asyncio.run(_wait_idle(target, timeout=seconds))
    return (status.num_running, status.num_waiting, status.kv_cache_usage) == (0, 0, 0.0)


def test_a_refused_decode_leg_frees_the_prefill_blocks_at_once(
    nixl_short_decode: Stack,
) -> None:
    router, prefill, decode = (p.target for p in nixl_short_decode)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_generate(router, LONG))
    # The decode pod's own refusal, passed through; its engine never saw it.
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "decode pod" in (err.value.details() or "")
    assert "prompt: has" in (err.value.details() or "")
    assert not was_refused(err.value)  # the prefill leg ran
    assert _freed_within(prefill, 10.0), "the prefill pod held the blocks (lease is 30 s)"
    _idle(decode)


def test_a_first_token_that_ends_the_request_frees_the_prefill_blocks(
    nixl_short_decode: Stack,
) -> None:
    """PROMPTS[5]'s greedy first token is EOS: no decode leg runs."""
    router, prefill, _ = (p.target for p in nixl_short_decode)
    got = asyncio.run(_generate(router, PROMPTS[5], ignore_eos=False))
    assert len(got.token_ids) == 1 and got.finish_reason == pb.FINISH_REASON_STOP
    assert _freed_within(prefill, 10.0), "the prefill pod held the blocks (lease is 30 s)"


def test_a_cancel_at_any_phase_frees_both_pods_at_once(nixl_short_decode: Stack) -> None:
    """A client cancelling at the router before the first token, right
    after it or mid-decode: the prefill pod (30 s lease here) frees the
    blocks it may hold for the decode leg at once, as does the decode pod.
    (A short prompt: this stack's decode pod holds 64 tokens.)"""
    router, prefill, decode = (p.target for p in nixl_short_decode)
    cancel_at_every_phase(router, [prefill, decode], "Count from one to fifty.", 10.0)


def test_pd_over_nixl_behind_smg(
    nixl_short_decode: Stack, reference: list[pb.GenerateResponse]
) -> None:
    """smg's legs over NIXL. The prefill pod's lease is 30 s here, so both
    pods idle within 10 s of a cancel means its hold was released, not left
    to lapse. (This stack's decode pod holds 64 tokens: short prompts.)"""
    _, prefill, decode = (p.target for p in nixl_short_decode)
    short = [i for i, p in enumerate(PROMPTS) if not p.startswith(SYSTEM)]
    check_pd_behind_smg(
        prefill,
        decode,
        [PROMPTS[i] for i in short],
        [reference[i] for i in short],
        f"Run {uuid.uuid4().hex[:8]}. Tell me about the number seven.",
        "Count from one to fifty.",
        partial_blocks=True,
    )


# --- a prefill pod killed before the read ---------------------------------------
# Last in the module: the pod killed is nixl_short_decode's prefill pod
# (SMALL, a producer, never seen by nixl_pd's decode pod), done with by then,
# rather than one more start-up for a pod that serves a single request.


def test_prefill_pod_killed_before_the_read(
    server: ServerProcess, nixl_pd: Stack, nixl_short_decode: Stack
) -> None:
    """The decode pod cannot reach the prefill pod's blocks: it recomputes,
    and the answer is unchanged."""
    decode = nixl_pd[2].target
    ids, want = _want(server, FRESH[1])
    before = asyncio.run(_status(decode))
    pre = nixl_short_decode[1]  # killed, not drained (see ServerProcess.kill)
    first, params = _prefill_leg(pre.target, ids)
    pre.kill()
    rest = _decode_leg(decode, ids, first, params)
    assert first + list(rest.token_ids) == want
    assert rest.usage.cached_tokens == 0  # all recomputed
    assert f"NIXL peer {pre.target} refused" in nixl_pd[2].log()
    _idle(decode)
    # Counted on the decode pod: a failed load by kind, and its tokens.
    after = asyncio.run(_status(decode))
    assert after.kv_recomputed_tokens - before.kv_recomputed_tokens == len(ids)
    failures = Counter(after.kv_transfer_failures)
    failures.subtract(before.kv_transfer_failures)
    assert +failures == {"peer_unreachable": 1}
