"""``tandem.v1.KVTransfer``: the side channel KV connectors' peers call.

A decode pod's NixlConnector fetches a prefill pod's handshake (its NIXL
agent metadata and KV layout) here, on the prefill pod's own gRPC port. The
servicer only relays the engine connector's payload; the connector owns
what it means.
"""

from __future__ import annotations

import socket
from dataclasses import replace

import grpc
from google.protobuf import wrappers_pb2

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from service.gen.tandem.v1 import kv_transfer_pb2_grpc

# Connectors that publish a side channel and must know where it is.
SIDE_CHANNEL_CONNECTORS = ("nixl",)


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None

    async def GetHandshake(
        self, request: wrappers_pb2.StringValue, context: grpc.aio.ServicerContext
    ) -> wrappers_pb2.BytesValue:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading")
        assert self.engine is not None
        name = self.engine.config.kv_transfer.kv_connector if self.engine.config.kv_transfer else ""
        payload = self.engine.side_channel_payload()
        if payload is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"this pod's KV connector ({name or 'none'}) has no side channel",
            )
        if request.value and request.value != name:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"connector: this pod runs {name!r}, not {request.value!r}",
            )
        return wrappers_pb2.BytesValue(value=payload)


def with_side_channel(config: EngineConfig, host: str, port: int) -> EngineConfig:
    """Tells a side-channel connector where this server listens (unless its
    extra config says): peers are sent there. A wildcard --host publishes
    this host's address (a pod's IP in Kubernetes)."""
    kv = config.kv_transfer
    if kv is None or kv.kv_connector not in SIDE_CHANNEL_CONNECTORS:
        return config
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostbyname(socket.gethostname())
    extra = {"side_channel_host": host, "side_channel_port": port}
    extra.update(kv.kv_connector_extra_config)
    return replace(config, kv_transfer=replace(kv, kv_connector_extra_config=extra))
