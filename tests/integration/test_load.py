"""Load test against a real server: 200 concurrent streamed Generate calls,
about a third of them cancelled at random (mid-stream or before the first
chunk). Every other stream must complete in full, and afterwards the server
must be idle: nothing running or waiting and no KV block in use."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2

from service.client import TandemClient, make_request
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.servers import ServerProcess

NUM_CALLS = 128
SEED = 20240607
CALL_TIMEOUT_S = 300.0
IDLE_POLL_S = 10.0


@dataclass
class Plan:
    index: int
    prompt: list[int]
    max_tokens: int
    # None: run to the end; 0: cancel before the first chunk; n: after n chunks.
    cancel_after: int | None
    # For cancel_after == 0: how long to wait before cancelling (s).
    cancel_delay: float = 0.0


@dataclass
class Outcome:
    plan: Plan
    chunks: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    code: grpc.StatusCode | None = None
    details: str | None = None
    cancelled: bool = False  # we called .cancel() before the stream ended
    error: str | None = None  # anything unexpected on the client side


def make_plans(rng: random.Random) -> list[Plan]:
    plans = []
    for i in range(NUM_CALLS):
        prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(8, 40))]
        max_tokens = rng.randint(4, 24)
        cancel_after: int | None = None
        delay = 0.0
        if rng.random() < 1 / 3:
            if rng.random() < 0.15:
                cancel_after = 0
                delay = rng.uniform(0.0, 0.05)
            else:
                cancel_after = rng.randint(1, 3)
        plans.append(Plan(i, prompt, max_tokens, cancel_after, delay))
    return plans


async def run_one(client: TandemClient, plan: Plan) -> Outcome:
    out = Outcome(plan)
    request = make_request(
        token_ids=plan.prompt,
        max_tokens=plan.max_tokens,
        temperature=1.0,
        ignore_eos=True,
        request_id=f"load-{plan.index}",
    )
    call = client.generate_call(request, timeout=CALL_TIMEOUT_S)
    try:
        if plan.cancel_after == 0:
            await asyncio.sleep(plan.cancel_delay)
            out.cancelled = call.cancel()
        else:
            async for chunk in call:
                out.chunks += 1
                out.token_ids.extend(chunk.token_ids)
                if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    out.finish_reason = chunk.finish_reason
                if (
                    plan.cancel_after is not None
                    and out.chunks >= plan.cancel_after
                    and out.finish_reason == pb.FINISH_REASON_UNSPECIFIED
                ):
                    out.cancelled = call.cancel()
                    break
    except grpc.aio.AioRpcError as exc:
        out.code, out.details = exc.code(), exc.details()
    except asyncio.CancelledError:
        # grpc.aio may surface our own cancel() this way; the call's code tells.
        if not out.cancelled:
            raise
    except Exception as exc:  # recorded and asserted on below
        out.error = repr(exc)
    if out.code is None:
        out.code = await call.code()
        out.details = await call.details()
    return out


async def wait_idle(client: TandemClient) -> tuple[pb.ServerStatus, list[str]]:
    """Polls GetServerStatus until idle (or IDLE_POLL_S passed); returns the
    last status and the history of what it saw."""
    deadline = time.monotonic() + IDLE_POLL_S
    seen: list[str] = []
    while True:
        status = await client.status()
        seen.append(
            f"running={status.num_running} waiting={status.num_waiting} "
            f"kv={status.kv_cache_usage!r}"
        )
        idle = status.num_running == 0 and status.num_waiting == 0 and status.kv_cache_usage == 0.0
        if idle or time.monotonic() >= deadline:
            return status, seen
        await asyncio.sleep(0.2)


async def run_load(target: str) -> tuple[list[Outcome], pb.ServerStatus, list[str], float]:
    plans = make_plans(random.Random(SEED))
    async with TandemClient(target) as client:
        t0 = time.monotonic()
        outcomes = await asyncio.gather(*(run_one(client, p) for p in plans))
        elapsed = time.monotonic() - t0
        status, seen = await wait_idle(client)
    return list(outcomes), status, seen, elapsed


@pytest.mark.timeout(600)
def test_concurrent_streams_with_random_cancels(server: ServerProcess) -> None:
    outcomes, status, seen, elapsed = asyncio.run(run_load(server.target))

    cancelled = [o for o in outcomes if o.cancelled]
    completed = [o for o in outcomes if not o.cancelled]
    summary = Counter(
        ("cancel" if o.cancelled else "full", o.plan.cancel_after is not None, str(o.code))
        for o in outcomes
    )
    report = (
        f"{len(outcomes)} calls in {elapsed:.1f} s: {len(completed)} completed, "
        f"{len(cancelled)} cancelled; (kind, planned cancel, code) -> count: "
        f"{dict(summary)}; idle polls: {seen[:3]}...{seen[-3:]}"
    )
    print(report)

    # Sanity of the plan itself: roughly a third cancelled, some before any chunk.
    assert 25 <= len(cancelled) <= 60, report
    assert any(o.plan.cancel_after == 0 for o in cancelled), report

    errors = [(o.plan.index, o.error) for o in outcomes if o.error]
    assert not errors, f"unexpected client errors {errors}; {report}"

    bad = [
        (o.plan.index, o.plan.max_tokens, len(o.token_ids), o.finish_reason, o.code, o.details)
        for o in completed
        if o.code != grpc.StatusCode.OK
        or o.finish_reason != pb.FINISH_REASON_LENGTH
        or len(o.token_ids) != o.plan.max_tokens
    ]
    assert not bad, (
        f"streams that did not complete in full "
        f"(index, max_tokens, got, finish, code, details): {bad}; {report}\n"
        f"server log:\n{server.log()}"
    )
    # Cancelled streams: recorded only (their content is not asserted on).

    assert (status.num_running, status.num_waiting, status.kv_cache_usage) == (0, 0, 0.0), (
        f"server not idle {IDLE_POLL_S} s after the load: {seen}; {report}\n"
        f"server log:\n{server.log()}"
    )

    assert server.proc is not None and server.proc.poll() is None, (
        f"server died; log:\n{server.log()}"
    )
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
