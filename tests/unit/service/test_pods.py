"""PodPool's pool addresses: a DNS name stands for one pod per address it
resolves to, followed as DNS changes; an IP literal is one pod, never resolved.
The resolver is a test double (a dict of answers); the pods' channels go to
loopback addresses where nothing listens, so polling them just fails."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
import pytest

from service.gen.tandem.v1 import generation_pb2 as pb
from service.pods import PodAccess, PodPool, PodState, dns_name

PORT = 9  # discard: nothing listens there


class FakeDns:
    """Answers from a dict: a list of addresses, or an exception to raise."""

    def __init__(self, answers: dict[str, list[str] | OSError]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        answer = self.answers.get(host, [])
        if isinstance(answer, OSError):
            raise answer
        return list(answer)


def _pool(addresses: list[str], dns: FakeDns, resolve_seconds: float = 3600.0) -> PodPool:
    return PodPool(
        "decode",
        addresses,
        follow_kv_events=True,
        poll_seconds=0.05,
        resolve_seconds=resolve_seconds,
        resolver=dns,
    )


def _addresses(pool: PodPool) -> list[str]:
    return [pod.address for pod in pool.pods]


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_which_addresses_are_dns_names() -> None:
    assert dns_name("tandem-decode.ns.svc.cluster.local:50051") == (
        "tandem-decode.ns.svc.cluster.local",
        50051,
    )
    assert dns_name("localhost:50051") == ("localhost", 50051)
    for given_as_is in ("127.0.0.1:50051", "[::1]:50051", "dns:///x:50051", "unix:/tmp/s", "x"):
        assert dns_name(given_as_is) is None, given_as_is


def test_a_name_becomes_a_pod_per_address_and_follows_dns() -> None:
    dns = FakeDns({"pool": ["127.0.0.2", "127.0.0.3"]})

    async def run() -> None:
        pool = _pool([f"pool:{PORT}"], dns)
        assert pool.pods == []  # until resolved
        pool.start()
        await _until(lambda: len(pool.pods) == 2)
        assert _addresses(pool) == [f"127.0.0.2:{PORT}", f"127.0.0.3:{PORT}"]
        assert dns.asked == [("pool", PORT)]
        gone, kept = pool.pods
        assert all(len(pod.tasks) == 2 for pod in pool.pods)  # polling and KV events

        dns.answers["pool"] = ["127.0.0.3", "127.0.0.4"]
        await pool.resolve()
        assert _addresses(pool) == [f"127.0.0.3:{PORT}", f"127.0.0.4:{PORT}"]
        assert pool.pods[0] is kept  # not reconnected
        assert len(pool.pods[1].tasks) == 2  # followed like the first ones
        assert all(not task.done() for pod in pool.pods for task in pod.tasks)
        await _until(lambda: all(task.done() for task in gone.tasks))
        assert not gone.healthy
        with pytest.raises(grpc.aio.UsageError):  # its channel is closed
            await gone.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=1.0)
        await pool.close()

    asyncio.run(run())


def test_pods_keep_the_order_of_the_addresses_given() -> None:
    dns = FakeDns({"b": ["127.0.0.3"]})

    async def run() -> None:
        pool = _pool([f"127.0.0.1:{PORT}", f"b:{PORT}", f"127.0.0.2:{PORT}"], dns)
        await pool.resolve()
        want = [f"127.0.0.1:{PORT}", f"127.0.0.3:{PORT}", f"127.0.0.2:{PORT}"]
        assert _addresses(pool) == want
        await pool.close()

    asyncio.run(run())


def test_ip_literals_are_never_resolved() -> None:
    dns = FakeDns({})

    async def run() -> None:
        pool = _pool([f"127.0.0.1:{PORT}", f"[::1]:{PORT}"], dns, resolve_seconds=0.01)
        assert _addresses(pool) == [f"127.0.0.1:{PORT}", f"[::1]:{PORT}"]
        pods = list(pool.pods)
        pool.start()
        await asyncio.sleep(0.1)
        await pool.resolve()
        assert dns.asked == []
        assert pool.pods == pods
        await pool.close()

    asyncio.run(run())


def test_a_name_resolving_to_nothing_has_no_pod_until_it_resolves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dns = FakeDns({})

    async def run() -> None:
        pool = _pool([f"127.0.0.1:{PORT}", f"pool:{PORT}"], dns)
        for _ in range(3):
            await pool.resolve()
        assert _addresses(pool) == [f"127.0.0.1:{PORT}"]
        assert not pool.any_healthy
        dns.answers["pool"] = ["127.0.0.2"]
        await pool.resolve()
        assert _addresses(pool) == [f"127.0.0.1:{PORT}", f"127.0.0.2:{PORT}"]
        await pool.close()

    with caplog.at_level(logging.INFO, logger="service.pods"):
        asyncio.run(run())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "logged once, not at each resolution"
    assert "resolves to no address" in warnings[0].getMessage()
    assert any("resolves again" in r.getMessage() for r in caplog.records)


def test_a_dns_failure_keeps_the_pods_known() -> None:
    dns = FakeDns({"pool": ["127.0.0.2"]})

    async def run() -> None:
        pool = _pool([f"pool:{PORT}"], dns)
        await pool.resolve()
        dns.answers["pool"] = OSError("Temporary failure in name resolution")
        await pool.resolve()
        assert _addresses(pool) == [f"127.0.0.2:{PORT}"]
        await pool.close()

    asyncio.run(run())


def test_pod_states_are_logged_and_counted_once_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pod that never answers is logged down once, with why; turning
    healthy and unhealthy again each log once and reach the callback."""
    changes: list[tuple[str, bool]] = []

    async def run() -> None:
        pool = PodPool(
            "prefill",
            [f"127.0.0.1:{PORT}"],
            follow_kv_events=False,
            poll_seconds=0.01,
            on_transition=lambda name, up: changes.append((name, up)),
        )
        (pod,) = pool.pods
        pool.start()
        await _until(lambda: pod.state == PodState.DOWN)
        await asyncio.sleep(0.1)  # more failed polls
        await pool.close()
        pool.set_state(pod, PodState.UP)
        pool.set_state(pod, PodState.UP)
        pool.set_state(pod, PodState.DRAINING)
        pool.set_state(pod, PodState.DOWN, "UNAVAILABLE: gone")

    with caplog.at_level(logging.INFO, logger="service.pods"):
        asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records]
    down = [m for m in messages if " is down: " in m]
    assert len(down) == 2, messages
    assert down[0].startswith(f"prefill pod 127.0.0.1:{PORT} is down: UNAVAILABLE")
    assert down[1] == f"prefill pod 127.0.0.1:{PORT} is down: UNAVAILABLE: gone"
    assert sum(" is up" in m for m in messages) == 1
    assert sum(" is draining" in m for m in messages) == 1
    assert changes == [("prefill", True), ("prefill", False)]  # healthy, then not


def test_pods_get_the_api_key_on_every_call() -> None:
    async def run() -> None:
        pool = PodPool(
            "decode",
            [f"127.0.0.1:{PORT}"],
            follow_kv_events=True,
            poll_seconds=1.0,
            access=PodAccess(api_key="k"),
        )
        assert pool.pods[0].metadata == (("authorization", "Bearer k"),)
        await pool.close()

    asyncio.run(run())


class _SlowStatusStub:
    """A pod whose status answers wait for `release`; it has adapter "a"
    only once `loaded` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.loaded = False
        self.asked = 0

    async def GetServerStatus(self, request: object, **_: object) -> pb.ServerStatus:
        self.asked += 1
        loaded = self.loaded  # the status as of the moment it was asked
        await self.release.wait()
        adapters = [pb.LoraAdapter(lora_name="a")] if loaded else []
        return pb.ServerStatus(lora_adapters=adapters)

    async def GetModelInfo(self, request: object, **_: object) -> pb.ModelInfo:
        return pb.ModelInfo(block_size=16, max_model_len=64)


def test_a_status_asked_before_the_routers_own_load_does_not_undo_it() -> None:
    """The router records an adapter it loaded through a pod at once; a
    status the pod answered before that load must not take it away (a
    request naming it would be refused until the next poll)."""

    async def go() -> None:
        pool = _pool(["127.0.0.1:9"], FakeDns({}))
        pod = pool.pods[0]
        stub = _SlowStatusStub()
        pod.stub = stub  # type: ignore[assignment]
        poll = asyncio.create_task(pool._poll(pod))
        try:
            await _until(lambda: stub.asked == 1)
            stub.loaded = True
            pod.set_lora("a", pb.LoraAdapter(lora_name="a"))
            stub.release.set()  # the stale answer (no "a") arrives
            await _until(lambda: pod.state == PodState.UP)
            assert list(pod.loras) == ["a"]
            await _until(lambda: stub.asked >= 3)  # later polls are the pod's word
            pod.loras.clear()
            await _until(lambda: list(pod.loras) == ["a"])
        finally:
            poll.cancel()
            await pool.close()

    asyncio.run(go())


class _FormatStub:
    async def GetServerStatus(self, request: object, **_: object) -> pb.ServerStatus:
        return pb.ServerStatus(weight_format="int8+float32")

    async def GetModelInfo(self, request: object, **_: object) -> pb.ModelInfo:
        return pb.ModelInfo(block_size=16, max_model_len=64)


def test_a_pods_status_says_its_weight_format_and_only_healthy_pods_count() -> None:
    async def go() -> None:
        pool = _pool(["127.0.0.1:9", "127.0.0.1:10"], FakeDns({}))
        pod, other = pool.pods
        pod.stub = _FormatStub()  # type: ignore[assignment]
        poll = asyncio.create_task(pool._poll(pod))
        try:
            await _until(lambda: pod.state == PodState.UP)
            assert pod.weight_format == "int8+float32"
            other.weight_format = "float32"  # said before it went down
            other.state = PodState.DOWN
            assert pool.weight_formats() == {"int8+float32"}
        finally:
            poll.cancel()
            await pool.close()

    asyncio.run(go())
