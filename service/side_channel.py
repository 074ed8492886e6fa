"""``tandem.v1.KVTransfer``: the side channel KV connectors' peers call.

A decode pod's NixlConnector fetches a prefill pod's handshake (its NIXL
agent metadata and KV layout) here, on the prefill pod's own gRPC port, and
claims each hold whose blocks it read (ReleaseHold). The
servicer only relays the engine connector's payload; the connector owns
what it means, and its class says whether it has one
(``KVConnectorBase.needs_side_channel``; a multi connector asks its tiers).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace

import grpc
from google.protobuf import wrappers_pb2

from engine.async_engine import AsyncEngine
from engine.config import ConfigError, EngineConfig, KVTransferConfig
from engine.kv_transfer.base import Claim
from engine.kv_transfer.registry import UnknownConnectorError, connector_class
from service.gen.tandem.v1 import kv_transfer_pb2_grpc

# How long a claim on a hold not registered yet waits for it (a hold is
# registered at the producer's next engine step, milliseconds away).
UNKNOWN_HOLD_WAIT_SECONDS = 5.0


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None

    async def GetHandshake(
        self, request: wrappers_pb2.StringValue, context: grpc.aio.ServicerContext
    ) -> wrappers_pb2.BytesValue:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading")
        assert self.engine is not None
        kv = self.engine.config.kv_transfer
        name = kv.kv_connector if kv else ""
        payload = self.engine.side_channel_payload()
        if payload is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"this pod's KV connector ({name or 'none'}) has no side channel",
            )
        if request.value and request.value != name and request.value not in _publishers(kv):
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"connector: this pod runs {name!r}, not {request.value!r}",
            )
        return wrappers_pb2.BytesValue(value=payload)

    async def ReleaseHold(
        self, request: wrappers_pb2.BytesValue, context: grpc.aio.ServicerContext
    ) -> wrappers_pb2.BoolValue:
        """A consumer's claim on a hold. A hold is registered at the engine
        step after its request finished, and a fast consumer can claim it
        before that: an UNKNOWN answer is asked again for a while."""
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading")
        assert self.engine is not None
        deadline = time.monotonic() + UNKNOWN_HOLD_WAIT_SECONDS
        while True:
            try:
                answer = self.engine.release_hold(request.value)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                raise  # context.abort raises; this keeps the type checker informed
            if answer is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "this pod's connector holds no KV")
            if answer is not Claim.UNKNOWN or time.monotonic() >= deadline:
                return wrappers_pb2.BoolValue(value=answer is Claim.HELD)
            await asyncio.sleep(0.01)


def _publishers(kv: KVTransferConfig | None) -> tuple[str, ...]:
    """The connectors, by name, whose side channel this pod serves."""
    if kv is None:
        return ()
    try:
        return connector_class(kv.kv_connector).side_channel_connectors(kv)
    except (UnknownConnectorError, ConfigError):
        return ()


def with_side_channel(config: EngineConfig, host: str, port: int) -> EngineConfig:
    """Tells a connector that needs a side channel where this server listens
    (unless its extra config says): peers are sent there. A wildcard --host
    publishes this host's address (a pod's IP in Kubernetes)."""
    kv = config.kv_transfer
    if not _publishers(kv):
        # None needed; or a bad connector config, which the engine reports
        # when it builds the connector.
        return config
    assert kv is not None
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostbyname(socket.gethostname())
    told = connector_class(kv.kv_connector).with_side_channel(kv, host, port)
    return replace(config, kv_transfer=told)
