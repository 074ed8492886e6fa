"""TLS and mutual TLS on a real server, with certificates made for the test."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from service.client import TandemClient
from tests.integration.servers import ServerProcess


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


def test_tls(pki: Path) -> None:
    args = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]
    with ServerProcess(args, check_health=False) as srv:
        srv.wait_serving(_creds(pki, client_cert=False))

        async def go() -> None:
            async with TandemClient(srv.target, tls_ca=pki / "ca.pem") as client:
                assert await _generate(client) == 3
            async with TandemClient(srv.target) as plaintext:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await plaintext.model_info()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        asyncio.run(go())


def test_mutual_tls_requires_a_client_certificate(pki: Path) -> None:
    args = [
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem"),
    ]  # fmt: skip
    with ServerProcess(args, check_health=False) as srv:
        srv.wait_serving(_creds(pki, client_cert=True))

        async def go() -> None:
            async with TandemClient(
                srv.target,
                tls_ca=pki / "ca.pem",
                tls_cert=pki / "client.pem",
                tls_key=pki / "client.key",
            ) as client:
                assert await _generate(client) == 3
            async with TandemClient(srv.target, tls_ca=pki / "ca.pem") as no_cert:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await no_cert.model_info()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        asyncio.run(go())
