"""What the engine's front doors (``LLM``, ``AsyncEngine``) raise to callers.

``service/errors.py`` maps each to a gRPC status code; nothing here knows
of gRPC.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request is malformed. ``field`` names the input that was wrong and
    ``index`` the element of it, if one was (``token_ids[3]: ...``); the
    message starts with both."""

    def __init__(self, field_name: str, message: str, *, index: int | None = None) -> None:
        where = field_name if index is None else f"{field_name}[{index}]"
        super().__init__(f"{where}: {message}")
        self.field = field_name
        self.index = index


class DuplicateRequestIdError(InvalidRequestError):
    """``request_id`` names a request this engine still has: a live one, or
    a finished one whose KV blocks it holds for a remote decode. Raised
    before the new request runs, so nothing of it ran and the request that
    has the id is left alone: a caller must not release or abort that id
    on the strength of this refusal."""

    def __init__(self, request_id: str, holder: str) -> None:
        super().__init__("request_id", f"{request_id!r} is already in use by {holder}")
        self.request_id = request_id


class EngineDrainingError(RuntimeError):
    """The engine is draining (shutting down) and admits no new requests."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured bound."""


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can complete."""
