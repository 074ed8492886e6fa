"""What both servicers (tandem.v1 and VllmEngine) share: the engine they
serve, which arrives after they are registered (the model loads while the
server already answers health)."""

from __future__ import annotations

import grpc

from engine import AsyncEngine
from service.errors import EngineLoadingError, abort_with


class EngineHolder:
    """Until ``attach``, ``engine`` raises EngineLoadingError (UNAVAILABLE)."""

    def __init__(self) -> None:
        self._engine: AsyncEngine | None = None

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise EngineLoadingError("the model is still loading; retry shortly")
        return self._engine

    async def _engine_for(self, context: grpc.aio.ServicerContext) -> AsyncEngine:
        """The engine, or the call ends UNAVAILABLE while the model loads."""
        try:
            return self.engine
        except EngineLoadingError as exc:
            await abort_with(context, exc)
            raise
