"""INVALID_ARGUMENT, not UNKNOWN, for request messages that do not decode.

gRPC parses a request with its method's deserializer before any servicer
code runs. A message that fails to parse (a string field that is not UTF-8,
truncated bytes, nesting deeper than protobuf's limit of 100) raised a
DecodeError there, which gRPC turns into UNKNOWN "Unexpected DecodeError"
and an ERROR traceback in the log for every such call. `DecodeGuard`, a
server interceptor, wraps each method's deserializer so such a message
becomes an `Undecodable`, and the method's handler so that it ends the call
INVALID_ARGUMENT ("request: ...") with one WARNING line instead.

Handlers must be async (coroutines or async generators; every servicer
here is); a synchronous one is left as it is. A handler that reads its
requests with ``context.read()`` would see the `Undecodable` itself.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

logger = logging.getLogger(__name__)

Behavior = Callable[..., Any]


@dataclass(frozen=True)
class Undecodable:
    """What the guarded deserializer returns for bytes that do not parse."""

    reason: str


class DecodeGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self) -> None:
        # method -> (its handler, the guarded one): built once per method.
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is None or cached[0] is not handler:
            cached = (handler, _guarded(handler, method))
            self._guarded[method] = cached
        return cached[1]


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    deserializer = handler.request_deserializer
    if deserializer is None:  # raw bytes: nothing to decode
        return handler
    kind = (
        ("stream" if handler.request_streaming else "unary")
        + "_"
        + ("stream" if handler.response_streaming else "unary")
    )
    behavior = _guard_behavior(getattr(handler, kind), method, handler.request_streaming)
    if behavior is None:
        return handler
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    guarded: grpc.RpcMethodHandler = make(
        behavior,
        request_deserializer=_guard_deserializer(deserializer),
        response_serializer=handler.response_serializer,
    )
    return guarded


def _guard_deserializer(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return decode


def _guard_behavior(behavior: Behavior, method: str, request_streaming: bool) -> Behavior | None:
    def argument(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return _checked(request, context, method) if request_streaming else request

    if inspect.isasyncgenfunction(behavior):

        async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await _refuse(context, method, request)
            async with aclosing(behavior(argument(request, context), context)) as responses:
                async for response in responses:
                    yield response

        return generate
    if inspect.iscoroutinefunction(behavior):

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await _refuse(context, method, request)
            return await behavior(argument(request, context), context)

        return call
    return None


async def _checked(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str
) -> AsyncIterator[Any]:
    """A request stream that ends the call at its first undecodable message."""
    async for request in requests:
        if isinstance(request, Undecodable):
            await _refuse(context, method, request)
        yield request


async def _refuse(context: grpc.aio.ServicerContext, method: str, bad: Undecodable) -> None:
    """Ends the call INVALID_ARGUMENT (raises, as context.abort does)."""
    logger.warning("%s from %s: request does not decode: %s", method, context.peer(), bad.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: does not decode: {bad.reason}")
