"""TLS material for Tandem's gRPC front doors and for their calls to pods.

One place for what `tandem serve` and `tandem router` both do: server
credentials (TLS, or mTLS with a client CA), and channel credentials to
reach a server that requires TLS (and a client certificate). Binding the
port is service.grpc_server's `listen`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from engine.config import ConfigError


def _read(name: str, path: Path) -> bytes:
    """A PEM file's bytes; ConfigError naming the setting if it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{name}: cannot read {path}: {e.strerror or e}") from None


@dataclass(frozen=True)
class ServerTLS:
    """A server's side: its certificate and key, and with `client_ca`,
    clients must present a certificate that CA signed (mTLS)."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.client_ca is not None and self.cert is None:
            raise ConfigError("tls_client_ca: needs tls_cert and tls_key (mTLS is TLS plus this)")

    def credentials(self) -> grpc.ServerCredentials | None:
        """None without a certificate (plaintext)."""
        if self.cert is None or self.key is None:
            return None
        pair = (_read("tls_key", self.key), _read("tls_cert", self.cert))
        client_ca = _read("tls_client_ca", self.client_ca) if self.client_ca else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


@dataclass(frozen=True)
class ClientTLS:
    """How to reach servers that require TLS: the CA to verify them with,
    and a certificate and key for servers that require one (mTLS).
    `server_name`: the name to check their certificates for, when it is not
    the address dialled (pods reached by IP with a certificate for a name)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("tls_cert and tls_key (client side): give both or neither")
        if self.ca is None and (self.cert is not None or self.server_name):
            raise ConfigError("a client certificate or server name needs the CA (tls_ca)")

    def credentials(self) -> grpc.ChannelCredentials | None:
        """None without a CA (plaintext)."""
        if self.ca is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read("tls_ca", self.ca),
            private_key=_read("tls_key", self.key) if self.key else None,
            certificate_chain=_read("tls_cert", self.cert) if self.cert else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def open_channel(target: str, tls: ClientTLS | None = None) -> grpc.aio.Channel:
    """An insecure channel, or a TLS one when `tls` names a CA."""
    credentials = tls.credentials() if tls is not None else None
    if credentials is None or tls is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, credentials, options=tls.channel_options())
