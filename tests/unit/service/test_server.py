"""TandemServer's start-up loads of --lora-modules, over a stand-in engine."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from engine import AsyncEngine, ConfigError, EngineConfig, InvalidRequestError
from engine.config import LoRAConfig
from engine.lora.request import LoRARequest
from service.server import ServerConfig, TandemServer


class _Engine:
    """load_lora as AsyncEngine's: reads (here: refuses) the adapter at a path."""

    def __init__(self) -> None:
        self.loaded: list[LoRARequest] = []

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        if path.endswith("bad"):
            raise InvalidRequestError("lora_path", f"{path}/adapter_config.json: missing")
        request = LoRARequest(name, len(self.loaded) + 1, path, f"lora:{name}")
        self.loaded.append(request)
        return request

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loaded)


def _load(modules: tuple[tuple[str, str], ...]) -> tuple[_Engine, TandemServer]:
    engine = _Engine()

    async def go() -> TandemServer:
        server = TandemServer(
            EngineConfig(lora=LoRAConfig()), ServerConfig(port=0, lora_modules=modules)
        )
        await server._load_lora_modules(cast(AsyncEngine, engine))
        return server

    return engine, asyncio.run(go())


def test_lora_modules_are_loaded_before_serving() -> None:
    engine, server = _load((("a", "/x/a"), ("b", "/x/b")))
    assert [r.lora_name for r in engine.loaded] == ["a", "b"]
    assert server.metrics.registry.get_sample_value("tandem_lora_adapters_loaded") == 2


def test_a_lora_module_that_does_not_load_stops_the_start() -> None:
    with pytest.raises(ConfigError) as info:
        _load((("a", "/x/a"), ("b", "/x/bad")))
    assert str(info.value) == (
        "--lora-modules b=/x/bad: lora_path: /x/bad/adapter_config.json: missing"
    )


def test_lora_modules_need_lora_on() -> None:
    with pytest.raises(ConfigError, match="lora_modules: LoRA is off"):
        TandemServer(EngineConfig(), ServerConfig(lora_modules=(("a", "/x"),)))
