"""P/D with an int8 KV cache (issue 44): prefill and decode pods that both
keep int8 blocks (values and a float32 scale per row, kernels/kv_int8.py)
hand them over the shared-memory connector and over Redis as they are, and
the router's answers equal a colocated int8 pod's. A decode pod whose cache is bfloat16
never reads the int8 blocks (their keys name the cache dtype): it
recomputes the prompt, and counts it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

import pytest

from service.convert import struct_to_dict
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.redis_server import REDIS_SERVER, RedisServer
from tests.integration.servers import ServerProcess, launched, serving
from tests.integration.test_pd import (
    PROMPTS,
    SMALL,
    _check_parity,
    _generate,
    _generate_all,
    _kv,
    _leg,
    _status,
    _tokenize,
    wait_router_sees_pods,
)

# The default path's int8 activations: every linear's row is the same at any
# batch, so answers do not depend on how batches form on either side (with
# float activations a colocated pod repeated the same 8 prompts x 120 tokens
# with 6 of 8 equal). Long answers: a decode pod's first output token takes
# the decode kernels after the prompt's tail (AttentionMetadata.prompt_rows);
# without that, 2 of 8 were equal at 120 tokens, parting from token 15 on.
INT8 = ["--kv-cache-dtype", "int8", "--int8-activations", "true", *SMALL]
LONG = 64


@pytest.fixture(scope="module")
def colocated() -> Iterator[ServerProcess]:
    pod = ServerProcess(INT8, exact=False)
    with launched(pod):
        yield pod


@pytest.fixture(scope="module")
def stacks(colocated: ServerProcess) -> Iterator[dict[str, tuple[str, ...]]]:
    """Both P/D stacks, their start-ups overlapping (``serving``): "shm" is
    (router, int8 prefill pod, int8 decode pod, bfloat16 decode pod) over one
    shared-memory pool, "redis" (router, int8 decode pod) of int8 pods over a
    Redis store (absent without redis-server)."""
    extra = {"pool_name": f"pd8-{uuid.uuid4().hex[:8]}", "capacity_bytes": 64 << 20}
    producer, consumer = _kv("shm", "kv_producer", extra), _kv("shm", "kv_consumer", extra)
    prefill = ServerProcess(["--role", "prefill", *INT8, *producer], exact=False)
    decode = ServerProcess(["--role", "decode", *INT8, *consumer], exact=False)
    bf16 = ["--kv-cache-dtype", "bfloat16", "--int8-activations", "false", *SMALL]
    # It waits this long for blocks that never come (10 s by default), then recomputes.
    impatient = _kv("shm", "kv_consumer", {**extra, "load_wait_seconds": 1.0})
    other = ServerProcess(["--role", "decode", *bf16, *impatient], exact=False)
    router = _router(prefill, decode)
    with contextlib.ExitStack() as stack:
        servers = [prefill, decode, other, router]
        found: dict[str, tuple[str, ...]] = {
            "shm": (router.target, prefill.target, decode.target, other.target)
        }
        if REDIS_SERVER is not None:
            store = stack.enter_context(RedisServer())
            extra = {"url": store.url, "key_prefix": f"i8{uuid.uuid4().hex[:6]}:"}
            r_producer = _kv("redis", "kv_producer", extra)
            r_consumer = _kv("redis", "kv_consumer", extra)
            r_prefill = ServerProcess(["--role", "prefill", *INT8, *r_producer], exact=False)
            r_decode = ServerProcess(["--role", "decode", *INT8, *r_consumer], exact=False)
            r_router = _router(r_prefill, r_decode)
            servers += [r_prefill, r_decode, r_router]
            found["redis"] = (r_router.target, r_decode.target)
        stack.enter_context(serving(*servers))
        for targets in found.values():
            wait_router_sees_pods(targets[0])
        # Launched first, so its start overlapped these; serving by now on a
        # quiet machine, not always on a busy one (a fresh clone's run got
        # "the model is still loading").
        colocated.wait_started()
        yield found


def _router(prefill: ServerProcess, decode: ServerProcess) -> ServerProcess:
    return ServerProcess(
        ["--prefill", prefill.target, "--decode", decode.target, "--poll-seconds", "0.2"],
        command="router",
    )


@pytest.fixture(scope="module")
def int8_pd(stacks: dict[str, tuple[str, ...]]) -> tuple[str, str, str, str]:
    """(router, int8 prefill pod, int8 decode pod, bfloat16 decode pod), one shm pool."""
    router, prefill, decode, other = stacks["shm"]
    return router, prefill, decode, other


@pytest.fixture(scope="module")
def redis_int8_pd(stacks: dict[str, tuple[str, ...]]) -> tuple[str, str]:
    """(router, decode pod) of int8 pods over a Redis store."""
    if "redis" not in stacks:
        pytest.skip("redis-server not installed")
    router, decode = stacks["redis"]
    return router, decode


def test_int8_blocks_hand_over_and_answers_equal_colocated(
    int8_pd: tuple[str, str, str, str], colocated: ServerProcess
) -> None:
    router, _, decode, _ = int8_pd
    _check_handover(router, decode, colocated)


def test_int8_blocks_over_redis_equal_colocated(
    redis_int8_pd: tuple[str, str], colocated: ServerProcess
) -> None:
    _check_handover(*redis_int8_pd, colocated)


def _check_handover(router: str, decode: str, colocated: ServerProcess) -> None:
    want: list[pb.GenerateResponse] = asyncio.run(_generate_all(colocated.target, PROMPTS, LONG))
    first = asyncio.run(_generate(router, PROMPTS[0], LONG))
    # The decode pod loaded the prompt's blocks, and recomputed none of it.
    status = asyncio.run(_status(decode))
    assert status.kv_connector_hits >= 16 * (first.usage.prompt_tokens // 16 - 1)
    assert status.kv_recomputed_tokens == 0
    got = asyncio.run(_generate_all(router, PROMPTS, LONG))
    _check_parity([first], want[:1])
    _check_parity(got, want)


def test_a_decode_pod_with_another_cache_dtype_recomputes(
    int8_pd: tuple[str, str, str, str], colocated: ServerProcess
) -> None:
    _, prefill, _, other = int8_pd
    ids = asyncio.run(_tokenize(colocated.target, PROMPTS[3]))
    first = asyncio.run(_leg(prefill, ids, 1, {"do_remote_decode": True}))
    params = struct_to_dict(first.kv_transfer_params)
    before = asyncio.run(_status(other))
    done = asyncio.run(_leg(other, ids + list(first.token_ids), 4, params))
    after = asyncio.run(_status(other))
    assert len(done.token_ids) == 4  # it answered, from its own prefill
    assert after.kv_connector_hits == before.kv_connector_hits  # read nothing
    assert after.kv_recomputed_tokens > before.kv_recomputed_tokens
