"""LoRA adapters loaded and unloaded on a pod: the one path for the
LoadLoraAdapter / UnloadLoraAdapter RPCs (service.servicer, tandem.v1) and
``--lora-modules`` at start (service.server).

Each load or unload checks that the server serves adapters at all
(LoRADisabledError, FAILED_PRECONDITION: no argument could succeed), goes
through the engine (which owns the registry and refuses a bad name or
directory with InvalidRequestError, INVALID_ARGUMENT), is logged, and
reports the new number of adapters to ``on_change`` (the metrics gauge).
An RPC's failure becomes its gRPC status through service.errors
(``*_or_abort``); a start-up load's becomes a ConfigError naming the flag.

The ``vllm.grpc.engine`` protocol that smg speaks has no adapter RPCs (and
no adapter field in its GenerateRequest), so service.vllm_servicer has
none: adapters are managed over tandem.v1 (``tandem lora``, the router),
and smg reaches one as the model of its own port (service/adapter_ports.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc

from engine import AsyncEngine, ConfigError, InvalidRequestError
from engine.lora.request import LoRARequest
from service.errors import LoRADisabledError, abort_with

logger = logging.getLogger(__name__)


class LoRAAdapters:
    def __init__(self, on_change: Callable[[int], None] | None = None) -> None:
        self.on_change = on_change

    async def load(self, engine: AsyncEngine, name: str, path: str) -> LoRARequest:
        """Raises LoRADisabledError, or the engine's InvalidRequestError."""
        require_lora(engine)
        loaded = await engine.load_lora(name, path)
        logger.info("LoRA adapter %r loaded from %s", loaded.lora_name, loaded.lora_path)
        self._changed(engine)
        return loaded

    def unload(self, engine: AsyncEngine, name: str) -> LoRARequest:
        """Raises LoRADisabledError, or the engine's InvalidRequestError.
        Requests running under the adapter finish first (the engine's)."""
        require_lora(engine)
        unloaded = engine.unload_lora(name)
        logger.info("LoRA adapter %r unloaded", unloaded.lora_name)
        self._changed(engine)
        return unloaded

    async def load_or_abort(
        self, context: grpc.aio.ServicerContext, engine: AsyncEngine, name: str, path: str
    ) -> LoRARequest:
        """``load`` for an RPC: a failure ends the call with its status."""
        try:
            return await self.load(engine, name, path)
        except Exception as exc:
            await abort_with(context, exc)
            raise

    async def unload_or_abort(
        self, context: grpc.aio.ServicerContext, engine: AsyncEngine, name: str
    ) -> LoRARequest:
        """``unload`` for an RPC: a failure ends the call with its status."""
        try:
            return self.unload(engine, name)
        except Exception as exc:
            await abort_with(context, exc)
            raise

    async def load_at_start(self, engine: AsyncEngine, modules: Sequence[tuple[str, str]]) -> None:
        """``--lora-modules``, before the server reports SERVING. One that
        does not load stops the start (ConfigError) with the engine's
        message naming the file at fault. The server has checked that LoRA
        is on (ServerConfig.lora_modules needs EngineConfig.lora)."""
        for name, path in modules:
            try:
                loaded = await engine.load_lora(name, path)
            except InvalidRequestError as exc:
                raise ConfigError(f"--lora-modules {name}={path}: {exc}") from None
            logger.info("LoRA adapter %r loaded from %s", loaded.lora_name, loaded.lora_path)
        self._changed(engine)

    def _changed(self, engine: AsyncEngine) -> None:
        if self.on_change is not None:
            self.on_change(len(engine.list_loras()))


def require_lora(engine: AsyncEngine) -> None:
    """FAILED_PRECONDITION rather than the engine's INVALID_ARGUMENT: no
    argument could make a load succeed on this server."""
    if engine.config.lora is None:
        raise LoRADisabledError("this server serves no LoRA adapters (start it with --enable-lora)")
