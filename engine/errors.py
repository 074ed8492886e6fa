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


class EngineDrainingError(RuntimeError):
    """The engine is draining (shutting down) and admits no new requests."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured bound."""


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can complete."""
