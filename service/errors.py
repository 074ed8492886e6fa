"""The one place where exceptions become gRPC status codes.

INVALID_ARGUMENT    InvalidRequestError: the message starts with the field;
                    a request message that does not decode ("request: ...",
                    from service.decode_guard, which sees it before any RPC)
RESOURCE_EXHAUSTED  QueueFullError: the waiting queue is at its bound
UNAVAILABLE         EngineDrainingError (draining), EngineDeadError,
                    EngineLoadingError (the model is still loading),
                    RequestFailedError (the engine ended the request with an
                    error: a KV load failed under --kv-load-failure-policy fail;
                    raised by service.convert for the request's last output)
NOT_FOUND           AdapterNotLoadedError: a request on a LoRA adapter's own
                    port (--lora-port) while that adapter is not loaded (smg
                    answers it as HTTP 404, vLLM's answer to an unknown model)
FAILED_PRECONDITION LoRADisabledError: LoadLoraAdapter / UnloadLoraAdapter on
                    a server started without --enable-lora (no argument
                    could succeed: the server's configuration must change)
UNAUTHENTICATED     raised by the API-key interceptor (service.auth)
INTERNAL            anything else; logged with its traceback

A Generate call refused before its request ran also carries the trailing
metadata ``REFUSED_KEY``: nothing of it ran. That is every refusal at the
front door (invalid, duplicate id, queue full, draining) and the
scheduler's refusal of an id it still holds (``refused_by_engine``). The
router relies on it: it releases a prefill pod's KV that a refused decode
leg named, and releases nothing on a pod that refused its prefill leg.
"""

from __future__ import annotations

import logging

import grpc

from engine import EngineDeadError, EngineDrainingError, InvalidRequestError, QueueFullError
from engine.errors import DuplicateRequestIdError

logger = logging.getLogger(__name__)

# Trailing metadata key (value "1") of a call refused before its request
# reached the engine.
REFUSED_KEY = "tandem-refused"


class EngineLoadingError(RuntimeError):
    """The model is still loading: no RPC but health can be served yet."""


class RequestFailedError(RuntimeError):
    """The engine ended this request with an error; retrying may succeed."""


class LoRADisabledError(RuntimeError):
    """An adapter was to be loaded or unloaded on a server without LoRA."""


class AdapterNotLoadedError(RuntimeError):
    """A request reached the port of a LoRA adapter that is not loaded."""


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDrainingError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (EngineLoadingError, grpc.StatusCode.UNAVAILABLE),
    (RequestFailedError, grpc.StatusCode.UNAVAILABLE),
    (LoRADisabledError, grpc.StatusCode.FAILED_PRECONDITION),
    (AdapterNotLoadedError, grpc.StatusCode.NOT_FOUND),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `exc`."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def abort_with(
    context: grpc.aio.ServicerContext, exc: BaseException, *, refused: bool = False
) -> None:
    """Ends the call with `exc`'s status; `refused`: the request never
    reached the engine (sent as REFUSED_KEY). Raises (as context.abort does)."""
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("request failed", exc_info=exc)
    await context.abort(code, message, refused_metadata(refused))


def refused_metadata(refused: bool) -> tuple[tuple[str, str], ...]:
    return ((REFUSED_KEY, "1"),) if refused else ()


def refused_by_engine(exc: BaseException, num_requests: int) -> bool:
    """Whether `exc`, which ended an admitted call's stream, says that its
    request never ran: the scheduler refused its id, which a request it
    still holds has. Only for a call of one request: a sibling choice of a
    refused one may have run."""
    return num_requests == 1 and isinstance(exc, DuplicateRequestIdError)


def was_refused(error: grpc.aio.AioRpcError) -> bool:
    """Whether a call's failure says its request never reached an engine."""
    return any(key == REFUSED_KEY for key, _ in error.trailing_metadata() or ())
