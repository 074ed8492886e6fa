"""P/D under decode-pod preemption, over each connector, with real processes.

The decode pod's cache is too small for the requests it runs at once, so it
preempts (and resumes by recomputation) requests whose prompt KV came from
the prefill pod. The rule being tested: once a request's remote KV has
loaded it is never read again (the prefill pod may have freed and reused
those blocks), and a load counts as computed only the tokens it delivered.
Answers must equal the colocated server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import uuid
from collections.abc import Iterator

import pytest

from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.redis_server import REDIS_SERVER, RedisServer
from tests.integration.servers import ServerProcess, launched
from tests.integration.test_pd import (
    PROMPTS,
    _generate,
    _kv,
    _status,
    _wait_idle,
    wait_router_sees_pods,
)

# 24 MiB of float32 KV is 32 blocks (512 tokens) of the default model: one
# request fits, four of ~70 + 120 tokens do not.
TINY = ["--kv-cache-memory", "24M", "--max-model-len", "512"]
MAX_TOKENS = 120
CONCURRENT = PROMPTS[:4]

HAS_NIXL = importlib.util.find_spec("nixl_cu12") is not None


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> list[pb.GenerateResponse]:
    return asyncio.run(_all(server.target))


async def _all(target: str) -> list[pb.GenerateResponse]:
    return list(await asyncio.gather(*(_generate(target, p, MAX_TOKENS) for p in CONCURRENT)))


def _extra(connector: str, redis_url: str | None) -> dict[str, object]:
    if connector == "shm":
        return {"pool_name": f"pre-{uuid.uuid4().hex[:8]}", "capacity_bytes": 64 << 20}
    if connector == "redis":
        return {"url": redis_url, "key_prefix": f"p{uuid.uuid4().hex[:6]}:"}
    return {}


def _pod(role: str, kv: list[str]) -> ServerProcess:
    return ServerProcess(["--role", role, *TINY, *kv])


@dataclasses.dataclass(frozen=True)
class Stack:
    router: ServerProcess
    prefill: ServerProcess
    decode: ServerProcess
    shared_prefill: bool = False  # the session's: waited for, not drained here


@pytest.fixture(scope="module")
def stacks(request: pytest.FixtureRequest) -> Iterator[dict[str, Stack]]:
    """A router, prefill and decode pod with tiny caches per connector,
    launched together (their start-ups overlap); each test enters its own.
    Over NIXL the prefill pod is the session's (tests/integration/conftest.py:
    the same flags, TINY and a producer; test_pd's busy-decode stack uses it
    too), launched with the rest if no earlier module started it."""
    with contextlib.ExitStack() as resources:
        stacks: dict[str, Stack] = {}
        for connector in CONNECTORS:
            if connector == "nixl" and not HAS_NIXL:
                continue
            if connector == "redis" and REDIS_SERVER is None:
                continue
            url = resources.enter_context(RedisServer()).url if connector == "redis" else None
            extra = _extra(connector, url)
            shared = connector == "nixl"
            if shared:
                prefill = request.getfixturevalue("nixl_tiny_prefill")
            else:
                prefill = ServerProcess(
                    ["--role", "prefill", *TINY, *_kv(connector, "kv_producer", extra)]
                )
            decode = ServerProcess(
                ["--role", "decode", *TINY, *_kv(connector, "kv_consumer", extra)]
            )
            router = ServerProcess(
                ["--prefill", prefill.target, "--decode", decode.target, "--poll-seconds", "0.2"],
                command="router",
            )
            stacks[connector] = Stack(router, prefill, decode, shared)
        servers = [
            p
            for s in stacks.values()
            for p in ((s.decode, s.router) if s.shared_prefill else (s.prefill, s.decode, s.router))
        ]
        resources.enter_context(launched(*servers))
        yield stacks


CONNECTORS = ["nixl", "shm", "redis"]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_decode_preemption_keeps_answers(
    stacks: dict[str, Stack], reference: list[pb.GenerateResponse], connector: str
) -> None:
    if connector not in stacks:
        pytest.skip(f"{connector}: not installed here")
    stack = stacks[connector]
    with contextlib.ExitStack() as pods:
        if stack.shared_prefill:
            stack.prefill.wait_started()
        else:
            pods.enter_context(stack.prefill)
        pods.enter_context(stack.decode)
        pods.enter_context(stack.router)
        wait_router_sees_pods(stack.router.target)
        got = asyncio.run(_all(stack.router.target))
        status = asyncio.run(_status(stack.decode.target))
        assert status.num_preemptions > 0, f"{connector}: the decode pod never preempted"
        for i, (g, w) in enumerate(zip(got, reference, strict=True)):
            assert list(g.token_ids) == list(w.token_ids), (
                f"{connector} prompt {i}: {g.text!r} != {w.text!r}"
            )
            assert g.text == w.text
        # Nothing left held or running on either pod.
        for pod in (stack.prefill, stack.decode):
            idle = asyncio.run(_wait_idle(pod.target))
            assert (idle.num_running, idle.num_waiting, idle.kv_cache_usage) == (0, 0, 0.0)
