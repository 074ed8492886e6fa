"""A prefill pod's hold ends before its decode leg reads it: the decode leg
must never answer with what the freed blocks hold by then.

Real processes over NIXL: a prefill pod with a short transfer timeout and a
decode pod that runs one request at a time, so a victim's decode leg waits
in the queue (heartbeating) behind a long filler while its hold is freed,
by an Abort sent straight to the prefill pod, by the transfer timeout, or
never matches (forged params). Other prompts then reuse the freed blocks.
The READ still happens (NIXL cannot refuse one), but the decode pod's claim
on the hold is refused, so it recomputes: the answer equals the colocated
server's, and the decode pod counts a ``hold_lost`` failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from service.client import TandemClient
from service.convert import struct_to_dict
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.servers import ServerProcess, serving
from tests.integration.test_pd import _generate, _kv, _leg, _status, _tokenize, _wait_idle

pytest.importorskip("nixl_cu12", reason="nixl-cu12 not installed")

TIMEOUT = 2.0  # the prefill pod's --kv-transfer-timeout
VICTIM = "Victim question: what is the tallest mountain on Earth, and where is it?"
# Other prompts the prefill pod serves meanwhile, at once: with its cache of
# 34 blocks, their ~36 blocks take every free one, the victim's included.
OTHERS = [f"Filler {i}: " + "a long story about a red fox and a brown dog. " * 13 for i in range(4)]
TINY = ["--kv-cache-memory", "24M", "--max-model-len", "512"]


@dataclasses.dataclass(frozen=True)
class Pods:
    prefill: ServerProcess
    decode: ServerProcess


@pytest.fixture(scope="module")
def pods(nixl_busy_decode_pod: ServerProcess) -> Iterator[Pods]:
    """This module's prefill pod (its short transfer timeout) and the
    session's NIXL decode pod that runs one request at a time (SMALL,
    --max-num-seqs 1: tests/integration/conftest.py; test_pd's busy-decode
    stack uses it too, and the counters checked here are compared
    before/after)."""
    prefill = ServerProcess(
        [
            "--role",
            "prefill",
            *TINY,
            "--kv-transfer-timeout",
            str(TIMEOUT),
            *_kv("nixl", "kv_producer", {}),
        ]
    )
    decode = nixl_busy_decode_pod
    with serving(prefill):
        decode.wait_started()
        yield Pods(prefill, decode)


@pytest.fixture(scope="module")
def want(server: ServerProcess) -> tuple[list[int], list[int]]:
    """(the victim's prompt ids, the colocated server's 12 greedy tokens)."""
    ids = asyncio.run(_tokenize(server.target, VICTIM))
    return ids, list(asyncio.run(_generate(server.target, VICTIM)).token_ids)


def _hold_lost(target: str) -> int:
    return asyncio.run(_status(target)).kv_transfer_failures.get("hold_lost", 0)


async def _abort(target: str, request_id: str) -> None:
    async with TandemClient(target) as client:
        await client.stub.Abort(pb.AbortRequest(request_ids=[request_id]), timeout=10)


def _victim_after(
    pods: Pods,
    ids: list[int],
    end_hold: Callable[[str], None],
    forge: Callable[[dict[str, Any]], dict[str, Any]] = lambda p: p,
) -> list[int]:
    """The victim's two legs with its decode leg queued behind a filler on
    the decode pod while ``end_hold(prefill leg id)`` frees its hold and
    other prompts reuse the blocks; then the filler is cancelled and the
    victim runs. Returns the victim's tokens."""
    prefill, decode = pods.prefill.target, pods.decode.target

    async def run() -> list[int]:
        filler = asyncio.create_task(_generate(decode, "A filler that keeps the pod busy.", 1500))
        await _until(lambda: _running(decode, 1, 0), "the filler decodes")
        first = await _leg(prefill, ids, 1, {"do_remote_decode": True})
        params = forge(struct_to_dict(first.kv_transfer_params))
        victim = asyncio.create_task(_leg(decode, ids + list(first.token_ids), 11, params))
        await _until(lambda: _running(decode, 1, 1), "the victim's decode leg waits")
        await asyncio.to_thread(end_hold, str(params["remote_request_id"]))
        # Their KV goes where the victim's was.
        await asyncio.gather(*(_generate(prefill, prompt, 1) for prompt in OTHERS))
        assert not victim.done(), "the decode leg did not wait behind the filler"
        filler.cancel()  # the decode pod aborts it: the victim's turn
        rest = await victim
        return list(first.token_ids) + list(rest.token_ids)

    return asyncio.run(run())


async def _running(target: str, running: int, waiting: int) -> bool:
    status = await _status(target)
    return (status.num_running, status.num_waiting) == (running, waiting)


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


def _until_lapsed(target: str, lapsed: int) -> None:
    """Until the prefill pod has freed ``lapsed`` holds unread."""

    async def check() -> bool:
        return (await _status(target)).kv_leases_lapsed >= lapsed

    asyncio.run(_until(check, f"{lapsed} holds lapsed", timeout=TIMEOUT + 30))


def _check(pods: Pods, got: list[int], want: list[int], lost_before: int) -> None:
    assert got == want, "the decode leg answered from blocks its hold no longer owned"
    lost = _hold_lost(pods.decode.target)
    assert lost == lost_before + 1, f"hold_lost {lost_before} -> {lost}:\n{pods.decode.log()}"
    for target in (pods.prefill.target, pods.decode.target):
        idle = asyncio.run(_wait_idle(target))
        assert (idle.num_running, idle.num_waiting, idle.kv_cache_usage) == (0, 0, 0.0)


def test_an_abort_sent_straight_to_the_prefill_pod(
    pods: Pods, want: tuple[list[int], list[int]]
) -> None:
    ids, tokens = want
    before = _hold_lost(pods.decode.target)
    got = _victim_after(pods, ids, lambda rid: asyncio.run(_abort(pods.prefill.target, rid)))
    _check(pods, got, tokens, before)


def test_the_transfer_timeout_lapsing_while_the_decode_leg_waits(
    pods: Pods, want: tuple[list[int], list[int]]
) -> None:
    ids, tokens = want
    before = _hold_lost(pods.decode.target)
    lapsed = asyncio.run(_status(pods.prefill.target)).kv_leases_lapsed
    got = _victim_after(pods, ids, lambda rid: _until_lapsed(pods.prefill.target, lapsed + 1))
    _check(pods, got, tokens, before)
    assert asyncio.run(_status(pods.prefill.target)).kv_leases_lapsed == lapsed + 1


def test_forged_params_naming_other_blocks(pods: Pods, want: tuple[list[int], list[int]]) -> None:
    """A client that sends a decode pod kv_transfer_params of its own, with
    other blocks (say, another user's): the READ happens, the claim names
    blocks the hold does not own, and the decode pod recomputes."""
    ids, tokens = want
    before = _hold_lost(pods.decode.target)

    def other_blocks(params: dict[str, Any]) -> dict[str, Any]:
        # Neighbours of its own blocks: inside the prefill pod's 34 blocks.
        blocks = [(int(b) + 1) % 34 for b in params["remote_block_ids"]]
        return {**params, "remote_block_ids": blocks}

    got = _victim_after(pods, ids, lambda rid: None, forge=other_blocks)
    _check(pods, got, tokens, before)
