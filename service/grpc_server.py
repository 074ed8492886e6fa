"""A gRPC server that owns its port, for `tandem serve` and `tandem router`.

gRPC sets SO_REUSEPORT by default on Linux: a second server on a taken port
then starts without complaint and the kernel splits connections between the
two. `new_server` turns that off, so `listen` on a taken port fails, as a
`ListenError` (a ConfigError: the CLI prints it on one line and exits 2).
It also accepts gateways' keepalive pings (see KEEPALIVE_OPTIONS).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from engine.config import ConfigError


class ListenError(ConfigError):
    """The address cannot be listened on (in use, or not this host's)."""


# Gateways keep idle channels alive with HTTP/2 pings (smg's gRPC client
# pings every few seconds, with or without calls). gRPC's defaults answer
# pings closer than 5 minutes apart with GOAWAY "too_many_pings", which drops
# every stream on the channel; these accept them.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    return grpc.aio.server(
        interceptors=list(interceptors), options=[("grpc.so_reuseport", 0), *KEEPALIVE_OPTIONS]
    )


def listen(
    server: grpc.aio.Server,
    address: str,
    credentials: grpc.ServerCredentials | None = None,
    flag: str = "--port",
) -> int:
    """Binds `address` (TLS with `credentials`); returns the port. Raises
    ListenError naming `flag` and the address when it is taken."""
    try:
        if credentials is None:
            port = int(server.add_insecure_port(address))
        else:
            port = int(server.add_secure_port(address, credentials))
    except RuntimeError:  # grpc's "Failed to bind to address ..."
        port = 0
    if port == 0:
        raise ListenError(f"{flag}: cannot listen on {address}: in use, or not an address here")
    return port
