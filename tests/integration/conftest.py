"""Real servers shared across the integration modules: the session's
colocated server (default model, loopback port), and NIXL pods whose flags
several modules use exactly alike (one start-up each instead of one per
module: a pod's start-up is ~5 s of a core, and idle it costs next to none)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.integration.servers import ServerProcess


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One `tandem serve` for the session, with metrics on. Tests must leave
    it idle (no request left running) when they finish. 64 running at most:
    part of test_load's 200 concurrent calls has to wait."""
    with ServerProcess(["--max-num-seqs", "64"], metrics=True) as srv:
        yield srv


def _nixl(role: str) -> list[str]:
    config = {"kv_connector": "nixl", "kv_role": role, "kv_connector_extra_config": {}}
    return ["--kv-transfer-config", json.dumps(config)]


def _shared(pod: ServerProcess) -> Iterator[ServerProcess]:
    """Launches `pod` without waiting (its start-up overlaps what the first
    module asking for it starts too: call `pod.wait_started()` before use);
    drains it at the session's end, its exit code checked (as `serving`)."""
    pod.start()
    try:
        yield pod
    except BaseException:
        pod.kill()
        raise
    pod.__exit__(None, None, None)


# A prefill pod's cache of 24 MiB of float32 KV: 34 blocks (~512 tokens).
NIXL_TINY_PREFILL = [
    "--role", "prefill", "--kv-cache-memory", "24M", "--max-model-len", "512", *_nixl("kv_producer")
]  # fmt: skip
# A decode pod that runs one request at a time (a second decode leg waits).
NIXL_BUSY_DECODE = [
    "--role", "decode", "--kv-cache-memory", "256M", "--max-model-len", "2048",
    "--max-num-seqs", "1", *_nixl("kv_consumer"),
]  # fmt: skip


@pytest.fixture(scope="session")
def nixl_tiny_prefill() -> Iterator[ServerProcess]:
    """A NIXL prefill pod with a tiny cache (default lease and transfer
    timeout): test_pd's busy-decode stack and test_pd_preemption's NIXL
    stack. Each test leaves it idle (no request, no block held); decode pods
    of several stacks read from it (each handshakes it once)."""
    yield from _shared(ServerProcess(NIXL_TINY_PREFILL))


@pytest.fixture(scope="session")
def nixl_busy_decode_pod() -> Iterator[ServerProcess]:
    """A NIXL decode pod running one request at a time, metrics on:
    test_nixl_holds' and test_pd's busy-decode stack. Each test leaves it
    idle; its counters only ever grow, so tests compare them before/after."""
    yield from _shared(ServerProcess(NIXL_BUSY_DECODE, metrics=True))
