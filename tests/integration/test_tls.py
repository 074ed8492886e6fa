"""TLS and mutual TLS on a real server, with certificates made for the test."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2

from service.client import TandemClient
from tests.integration.servers import ServerProcess, launched


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(
    subject: str, issuer: tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None, ca: bool
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer_key, issuer_name = (
        (key, _name(subject))
        if issuer is None
        else (
            issuer[0],
            issuer[1].subject,
        )
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return key, builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    ca = _issue("tandem-test-ca", None, ca=True)
    _write(root / "ca", *ca)
    _write(root / "server", *_issue("127.0.0.1", ca, ca=False))
    _write(root / "client", *_issue("client", ca, ca=False))
    return root


def _creds(pki: Path, client_cert: bool) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
    )


async def _generate(client: TandemClient) -> int:
    return sum([len(c.token_ids) async for c in client.generate(text="Hi", max_tokens=3)])


POD_KEY = "pod-s3cret"
ROUTER_KEY = "router-s3cret"


@dataclass(frozen=True)
class TLSServers:
    tls: ServerProcess  # TLS, no client certificate asked
    mtls: ServerProcess  # a client certificate and an API key required


@pytest.fixture(scope="module")
def tls_servers(pki: Path) -> Iterator[TLSServers]:
    """Both launched at once (their start-ups overlap); each is entered
    where it is used."""
    tls = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]
    mtls = [*tls, "--tls-client-ca", str(pki / "ca.pem"), "--api-key", POD_KEY]
    servers = TLSServers(
        tls=ServerProcess(tls, check_health=False), mtls=ServerProcess(mtls, check_health=False)
    )
    with launched(servers.tls, servers.mtls):
        yield servers


def test_tls(pki: Path, tls_servers: TLSServers) -> None:
    with tls_servers.tls as srv:
        srv.wait_serving(_creds(pki, client_cert=False))

        async def go() -> None:
            async with TandemClient(srv.target, tls_ca=pki / "ca.pem") as client:
                assert await _generate(client) == 3
            async with TandemClient(srv.target) as plaintext:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await plaintext.model_info()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        asyncio.run(go())


@pytest.fixture(scope="module")
def mtls_server(pki: Path, tls_servers: TLSServers) -> Iterator[ServerProcess]:
    """A server requiring a client certificate and an API key."""
    with tls_servers.mtls as srv:
        srv.wait_serving(_creds(pki, client_cert=True))
        yield srv


def _client(target: str, pki: Path, *, cert: bool = True, key: str | None = None) -> TandemClient:
    """A TLS client (verifying with the test CA), with the client certificate
    unless `cert` is false, sending `key`."""
    return TandemClient(
        target,
        api_key=key,
        tls_ca=pki / "ca.pem",
        tls_cert=pki / "client.pem" if cert else None,
        tls_key=pki / "client.key" if cert else None,
    )


async def _code(client: TandemClient) -> grpc.StatusCode:
    async with client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.model_info()
    return info.value.code()


def test_mutual_tls_requires_a_client_certificate(pki: Path, mtls_server: ServerProcess) -> None:
    async def go() -> None:
        async with _client(mtls_server.target, pki, key=POD_KEY) as client:
            assert await _generate(client) == 3
        no_cert = _client(mtls_server.target, pki, cert=False, key=POD_KEY)
        assert await _code(no_cert) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(go())


def _router_args(pki: Path, pod: ServerProcess) -> list[str]:
    """A router in front of the mTLS + key pod, guarded the same way."""
    return [
        "--decode", pod.target,
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem"), "--api-key", ROUTER_KEY,
        "--pod-tls-ca", str(pki / "ca.pem"), "--pod-tls-cert", str(pki / "client.pem"),
        "--pod-tls-key", str(pki / "client.key"), "--pod-api-key", POD_KEY,
        "--poll-seconds", "0.2",
    ]  # fmt: skip


def test_the_router_guards_its_door_and_reaches_guarded_pods(
    pki: Path, mtls_server: ServerProcess
) -> None:
    """Clients need the router's certificate chain, a client certificate and
    the router's key (health stays open); the router reaches the pod over
    mTLS with the pod's key."""
    router = ServerProcess(_router_args(pki, mtls_server), command="router", check_health=False)
    with router:
        router.wait_serving(_creds(pki, client_cert=True))  # health: no key needed

        async def go() -> None:
            async with _client(router.target, pki, key=ROUTER_KEY) as client:
                assert await _generate(client) == 3
                status = await client.status()
                assert status.uptime_seconds > 0 and status.num_pods_healthy == 1
            no_key = _client(router.target, pki)
            assert await _code(no_key) == grpc.StatusCode.UNAUTHENTICATED
            pods_key = _client(router.target, pki, key=POD_KEY)  # not the router's
            assert await _code(pods_key) == grpc.StatusCode.UNAUTHENTICATED
            no_cert = _client(router.target, pki, cert=False, key=ROUTER_KEY)
            assert await _code(no_cert) == grpc.StatusCode.UNAVAILABLE
            async with TandemClient(router.target, api_key=ROUTER_KEY) as plaintext:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await plaintext.model_info()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        asyncio.run(go())


def test_a_router_without_the_pods_key_says_why_they_are_down(
    pki: Path, mtls_server: ServerProcess
) -> None:
    """It cannot use the pod: NOT_SERVING, and its log says the pod refused
    its (missing) key, once."""
    args = _router_args(pki, mtls_server)
    i = args.index("--pod-api-key")
    del args[i : i + 2]
    router = ServerProcess(args, command="router", check_health=False)
    with router:
        deadline = time.monotonic() + 60
        while "is down" not in router.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # several more polls
        assert router.health(_creds(pki, client_cert=True)) == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
        log = router.log()
    assert log.count(f"decode pod {mtls_server.target} is down: UNAUTHENTICATED") == 1, log
