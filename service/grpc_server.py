"""A gRPC server that owns its address, for `tandem serve` and `tandem router`.

Both front doors are built here, so they check requests in the same order
and bind their ports by the same rules:

- Interceptors: the decode guard (service.decode_guard) runs outside the
  API-key check, so a message that does not parse gets INVALID_ARGUMENT
  "request: ..." and one WARNING whoever sends it; gRPC parses the body
  before any interceptor's handler runs, so an unauthenticated client could
  otherwise still reach the parser's UNKNOWN and traceback.
- SO_REUSEPORT, which gRPC sets by default on Linux, is off: a second
  server on a taken port would otherwise start without complaint and the
  kernel would split connections between the two.
- A host is bound on every address it resolves to: gRPC itself reports
  success when one of them binds, so `--host localhost` (127.0.0.1 and
  ::1) started beside a server holding 127.0.0.1:P, bound only [::1]:P,
  and clients dialling localhost:P reached the newcomer.

A failure is a `ListenError` (a ConfigError: the CLI prints it on one line
and exits) naming the flag and the address that could not be had. It also
accepts gateways' keepalive pings (see KEEPALIVE_OPTIONS).
"""

from __future__ import annotations

import errno
import logging
import socket

import grpc

from engine.config import ConfigError
from service.auth import ApiKeyInterceptor
from service.decode_guard import DecodeGuard

logger = logging.getLogger(__name__)


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

# Binding fails with these when the address cannot exist on this host (not
# one of its addresses; IPv6 off): no other process can hold it either, so
# such an address of a name is skipped, not a reason to refuse.
_NOT_HERE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def new_server(api_key: str | None = None) -> grpc.aio.Server:
    """A server whose every RPC but health needs `api_key` (None: open)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [DecodeGuard()]
    if api_key:
        interceptors.append(ApiKeyInterceptor(api_key))
    return grpc.aio.server(
        interceptors=interceptors, options=[("grpc.so_reuseport", 0), *KEEPALIVE_OPTIONS]
    )


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets (`[::1]:50051`), as
    gRPC and clients parse it."""
    host = _unbracketed(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(
    server: grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
    flag: str = "--port",
) -> int:
    """Binds `port` (0: one the system picks) on every address `host`
    resolves to, TLS with `credentials`; returns the port. Raises
    ListenError naming `flag` and the address that could not be bound."""
    bound = 0
    for family, address in _resolve(host, port, flag):
        wanted = bound or port  # port 0: every address gets the first one's port
        named = "" if address == _unbracketed(host) else f" ({host})"
        where = host_port(address, wanted) + named
        problem = _probe(family, address, wanted)
        if problem is not None and problem.errno in _NOT_HERE:
            logger.info("%s: not listening on %s: %s", flag, where, problem.strerror)
            continue
        if problem is not None:
            raise ListenError(f"{flag}: cannot listen on {where}: {problem.strerror or problem}")
        bound = _add_port(server, host_port(address, wanted), credentials)
        if bound == 0:
            raise ListenError(f"{flag}: cannot listen on {where}: in use, or not an address here")
    if bound == 0:
        raise ListenError(
            f"{flag}: cannot listen on {host_port(host, port)}: not an address of this host"
        )
    return bound


def _unbracketed(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _resolve(host: str, port: int, flag: str) -> list[tuple[socket.AddressFamily, str]]:
    """The distinct addresses `host` stands for (family, text), in resolver
    order."""
    if not _unbracketed(host):
        # gRPC reads ":P" as every interface; said explicitly, it is one
        # address to bind (0.0.0.0 or ::), not two that overlap.
        raise ListenError(f"{flag}: no host given: 0.0.0.0 or :: listen on every interface")
    try:
        infos = socket.getaddrinfo(
            _unbracketed(host), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as exc:
        where = host_port(host, port)
        raise ListenError(
            f"{flag}: cannot listen on {where}: cannot resolve {host!r}: {exc}"
        ) from None
    ip = (socket.AF_INET, socket.AF_INET6)
    found = [(info[0], str(info[4][0])) for info in infos if info[0] in ip]
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        # Clients' gRPC resolves localhost to both loopbacks whatever
        # /etc/hosts says (RFC 6761), so both are this server's to hold.
        found += [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
    return list(dict.fromkeys(found))


def _probe(family: socket.AddressFamily, address: str, port: int) -> OSError | None:
    """Why `address:port` cannot be bound, or None. With SO_REUSEADDR, as
    gRPC binds: a port left in TIME_WAIT is free, one listened on is not."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((address, port))
    except OSError as exc:
        return exc
    return None


def _add_port(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None
) -> int:
    try:
        if credentials is None:
            return int(server.add_insecure_port(address))
        return int(server.add_secure_port(address, credentials))
    except RuntimeError:  # grpc's "Failed to bind to address ..."
        return 0
