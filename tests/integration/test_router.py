"""`tandem router` as a front door, over real processes: with its only
prefill pod down it serves requests colocated on a decode pod (unless told
not to), counts that in its metrics and status, logs the pod's death once,
keeps pod addresses out of client errors, refuses a taken port (also as
one of localhost's addresses), listens on IPv6, and refuses bodies that do
not decode before it checks the API key.

Routers start in a second or two (no model); the decode pod is the
session's colocated server, which is also the reference."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from service.client import TandemClient, make_request
from tests.integration.servers import ROOT, ServerProcess, free_port
from tests.integration.test_pd import PROMPTS, _check_parity, _generate, _status
from tests.integration.test_service import _send_raw, _undecodable


def _metrics(port: int | None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample at the metrics endpoint: (name, labels) -> value."""
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _wait_pods_healthy(target: str, count: int, timeout: float = 60.0) -> int:
    """How many of the router's pods are healthy, once `count` are (or the
    time is up); the router may not listen yet at first."""
    deadline = time.monotonic() + timeout
    healthy = -1
    while healthy != count and time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            healthy = asyncio.run(_status(target)).num_pods_healthy
        except grpc.aio.AioRpcError:
            continue
    return healthy


async def _bad_request(target: str) -> grpc.aio.AioRpcError:
    async with TandemClient(target) as client:
        try:
            async for _ in client.stub.Generate(make_request(text="hi", temperature=-1.0)):
                pass
        except grpc.aio.AioRpcError as e:
            return e
    raise AssertionError("a negative temperature was accepted")


def test_with_its_prefill_pod_down_the_router_serves_colocated(server: ServerProcess) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    args = ["--prefill", dead, "--decode", server.target, "--poll-seconds", "0.2"]
    with ServerProcess(args, command="router", metrics=True) as router:
        got = asyncio.run(_generate(router.target, PROMPTS[0]))
        got_too = asyncio.run(_generate(router.target, PROMPTS[1]))
        error = asyncio.run(_bad_request(router.target))
        status = asyncio.run(_status(router.target))
        samples = _metrics(router.metrics_port)
        shown = subprocess.run(
            [sys.executable, "-m", "service.cli", "status", "--server", router.target],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        ).stdout
        log = router.log()
    want = asyncio.run(_generate(server.target, PROMPTS[0]))
    want_too = asyncio.run(_generate(server.target, PROMPTS[1]))
    _check_parity([got, got_too], [want, want_too])
    # The decode pod's own refusal, without its address.
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("decode pod: sampling.temperature")
    assert str(server.port) not in (error.details() or "")
    # Status: the router's own uptime and figures, its pods' counts summed.
    assert status.num_prefill_fallbacks == 3
    assert status.uptime_seconds > 0
    assert (status.num_pods, status.num_pods_healthy) == (2, 1)
    assert status.prefix_cache_queries > 0  # the decode pod's, summed
    assert "router     1/2 pods healthy; 3 requests served colocated" in shown, shown
    # Metrics.
    assert samples[("tandem_router_requests_total", ())] == 3
    assert samples[("tandem_router_prefill_fallbacks_total", ())] == 3
    assert samples[("tandem_router_legs_total", (("leg", "colocated"),))] == 3
    assert samples[("tandem_router_errors_total", (("code", "INVALID_ARGUMENT"),))] == 1
    up = (("pool", "decode"), ("state", "up"))
    assert samples[("tandem_router_pod_transitions_total", up)] == 1
    assert samples[("tandem_router_pods", (("pool", "prefill"),))] == 1
    assert samples[("tandem_router_pods_healthy", (("pool", "prefill"),))] == 0
    assert samples[("tandem_router_pods_healthy", (("pool", "decode"),))] == 1
    # Logged once each, however many polls and requests: the pod's death
    # (with why) and the start of the fallback.
    assert log.count(f"prefill pod {dead} is down: UNAVAILABLE") == 1, log
    assert log.count("prefill fallback: no prefill pod available") == 1, log


def test_without_prefill_fallback_the_router_fails_unavailable(server: ServerProcess) -> None:
    dead = f"127.0.0.1:{free_port()}"
    args = ["--prefill", dead, "--decode", server.target, "--poll-seconds", "0.2"]
    router = ServerProcess([*args, "--no-prefill-fallback"], command="router", check_health=False)
    with router:
        # Not SERVING (no prefill pod), but its decode pod is up: the
        # request fails for the want of a prefill pod, and for nothing else.
        assert _wait_pods_healthy(router.target, 1) == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(_generate(router.target, PROMPTS[0]))
        assert router.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "no prefill pod available"


@pytest.mark.parametrize("which", ["--port", "--metrics-port"])
def test_a_router_refuses_a_taken_port(server: ServerProcess, which: str) -> None:
    """The session server holds both ports: the router exits at once with
    one line naming the address, and the server keeps serving."""
    assert server.metrics_port is not None
    taken = server.port if which == "--port" else server.metrics_port
    cmd = [sys.executable, "-m", "service.cli", "router", "--decode", server.target]
    cmd += ["--port", "0", which, str(taken)] if which != "--port" else ["--port", str(taken)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{taken}" in done.stderr
    assert "Traceback" not in done.stderr
    assert server.health() == health_pb2.HealthCheckResponse.SERVING


def test_a_router_refuses_localhost_when_one_of_its_addresses_is_taken(
    server: ServerProcess,
) -> None:
    """The session server holds 127.0.0.1:P: a router on localhost:P would
    have bound [::1]:P alone and taken the clients that dial localhost:P."""
    cmd = [sys.executable, "-m", "service.cli", "router", "--decode", server.target]
    cmd += ["--host", "localhost", "--port", str(server.port)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"--port: cannot listen on 127.0.0.1:{server.port} (localhost): " in done.stderr
    assert "Traceback" not in done.stderr
    assert server.health() == health_pb2.HealthCheckResponse.SERVING


def test_a_router_on_every_ipv6_address_serves_both_families(server: ServerProcess) -> None:
    """`--host ::` (once "Misformatted domain name") listens on IPv6 and,
    dual-stack, on IPv4: health and a request answer on both loopbacks."""
    with ServerProcess(["--decode", server.target, "--host", "::"], command="router") as router:
        on_ipv6 = f"[::1]:{router.port}"
        got = asyncio.run(_generate(on_ipv6, PROMPTS[0]))
        healths = [router.health()]
        router.target = on_ipv6
        healths.append(router.health())
        log = router.log()
    assert healths == [health_pb2.HealthCheckResponse.SERVING] * 2
    _check_parity([got], [asyncio.run(_generate(server.target, PROMPTS[0]))])
    assert f"router on [::]:{router.port} (plaintext)" in log, log


def test_the_router_refuses_undecodable_bodies_before_the_api_key(server: ServerProcess) -> None:
    """Garbage, truncated or non-UTF-8 bodies sent with no key: INVALID_ARGUMENT
    and one WARNING each, never UNKNOWN and a traceback; a body that parses
    still needs the key."""
    cases = _undecodable()

    async def go() -> tuple[list[grpc.aio.AioRpcError], grpc.aio.AioRpcError]:
        errors = await _send_raw(router.target, cases)
        async with TandemClient(router.target) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await anonymous.model_info()
        return errors, info.value

    router = ServerProcess(["--decode", server.target, "--api-key", "k"], command="router")
    with router:
        errors, anonymous = asyncio.run(go())
        log = router.log()
    for (method, _), error in zip(cases, errors, strict=True):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error.details())
        assert (error.details() or "").startswith("request: does not decode"), error.details()
    assert anonymous.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "Traceback" not in log and " ERROR " not in log, log
    assert len([line for line in log.splitlines() if "does not decode" in line]) == len(cases)
