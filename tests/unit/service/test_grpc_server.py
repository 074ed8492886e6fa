"""The front doors' gRPC server: every address of a host bound or none,
IPv6 literals, and the decode guard outside the API-key check."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc
from service.grpc_server import ListenError, host_port, listen, new_server


@pytest.fixture
def held() -> Iterator[int]:
    """A port another process would hold: listened on at 127.0.0.1."""
    with socket.socket() as rival:
        rival.bind(("127.0.0.1", 0))
        rival.listen()
        yield int(rival.getsockname()[1])


async def _listen(host: str, port: int) -> int:
    server = new_server()
    try:
        return listen(server, host, port)
    finally:
        await server.stop(None)


def _refusal(host: str, port: int) -> str:
    with pytest.raises(ListenError) as info:
        asyncio.run(_listen(host, port))
    return str(info.value)


def test_localhost_is_refused_when_one_of_its_addresses_is_taken(held: int) -> None:
    """gRPC alone binds what it can of localhost's addresses ([::1]) and
    reports success; clients dialling localhost:P then reach the newcomer."""
    message = _refusal("localhost", held)
    assert message.startswith(f"--port: cannot listen on 127.0.0.1:{held} (localhost): "), message


def test_a_name_is_refused_when_any_address_it_resolves_to_is_taken(
    held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = socket.getaddrinfo

    def both(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "pod.test":
            return real(host, port, *args, **kwargs)
        return real("::1", port, *args, **kwargs) + real("127.0.0.1", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", both)
    message = _refusal("pod.test", held)
    assert message.startswith(f"--port: cannot listen on 127.0.0.1:{held} (pod.test): "), message


def test_port_zero_gets_one_port_on_every_address() -> None:
    async def go() -> int:
        server = new_server()
        try:
            port = listen(server, "localhost", 0)
            for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                with socket.socket(family) as rival, pytest.raises(OSError):
                    rival.bind((address, port))  # held by the server on both
            return port
        finally:
            await server.stop(None)

    assert asyncio.run(go()) > 0


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("", "--port: no host given: 0.0.0.0 or :: listen on every interface"),
        ("192.0.2.1", "--port: cannot listen on 192.0.2.1:0: not an address of this host"),
        ("tandem-nowhere.invalid", "--port: cannot listen on tandem-nowhere.invalid:0: cannot"),
    ],
)
def test_hosts_that_cannot_be_listened_on_are_named(host: str, message: str) -> None:
    assert _refusal(host, 0).startswith(message)


@pytest.mark.parametrize("host", ["::1", "[::1]", "::"])
def test_ipv6_hosts_listen_and_answer(host: str) -> None:
    async def go() -> int:
        server = new_server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = listen(server, host, 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(host_port("::1", port)) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            return int(reply.status)
        finally:
            await server.stop(None)

    assert asyncio.run(go()) == health_pb2.HealthCheckResponse.SERVING


def test_host_port_brackets_ipv6_literals() -> None:
    assert host_port("::", 5) == "[::]:5"
    assert host_port("[::1]", 5) == "[::1]:5"
    assert host_port("127.0.0.1", 5) == "127.0.0.1:5"
    assert host_port("localhost", 5) == "localhost:5"


class _Echo(pb_grpc.GenerationServicer):
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(text=request.text)


def _codes(
    api_key: str | None, bodies: list[bytes], metadata: tuple[tuple[str, str], ...]
) -> list[grpc.StatusCode]:
    async def go() -> list[grpc.StatusCode]:
        server = new_server(api_key)
        pb_grpc.add_GenerationServicer_to_server(_Echo(), server)  # type: ignore[no-untyped-call]
        port = listen(server, "127.0.0.1", 0)
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                generate = channel.unary_stream("/tandem.v1.Generation/Generate")
                for body in bodies:
                    try:
                        async for _ in generate(body, metadata=metadata, timeout=10):
                            pass
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
        finally:
            await server.stop(None)
        return codes

    return asyncio.run(go())


GOOD = pb.GenerateRequest(text="hello").SerializeToString()
BAD = GOOD.replace(b"hello", b"h\xffllo")  # not UTF-8


def test_undecodable_bodies_are_refused_before_the_api_key_check() -> None:
    """Whoever sends a body that does not parse gets INVALID_ARGUMENT (not
    UNKNOWN); a body that parses still needs the key."""
    invalid, unauthenticated = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED
    assert _codes("k", [BAD, GOOD], ()) == [invalid, unauthenticated]
    assert _codes("k", [BAD, GOOD], (("authorization", "Bearer k"),)) == [
        invalid,
        grpc.StatusCode.OK,
    ]
    assert _codes(None, [BAD, GOOD], ()) == [invalid, grpc.StatusCode.OK]
