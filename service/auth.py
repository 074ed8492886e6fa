"""API-key check for every RPC except health (`--api-key`).

Clients send the key as `authorization: Bearer KEY` (or `x-api-key: KEY`)
metadata. Health stays open so orchestrators can probe without secrets.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key: must be non-empty")
        self._key = api_key.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._authorized(metadata):
            return handler
        return _deny(handler)

    def _authorized(self, metadata: dict[str, Any]) -> bool:
        presented = metadata.get("x-api-key", "")
        auth = metadata.get("authorization", "")
        if isinstance(auth, str) and auth.lower().startswith("bearer "):
            presented = auth[7:].strip()
        if not isinstance(presented, str) or not presented:
            return False
        return hmac.compare_digest(presented.encode(), self._key)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or wrong API key: send 'authorization: Bearer <key>' metadata"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover (makes this an async generator)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
