"""service.adapters: LoRA loads and unloads, for the RPCs and --lora-modules
alike, over a stand-in engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from engine import AsyncEngine, ConfigError, InvalidRequestError
from engine.config import LoRAConfig
from engine.lora.request import LoRARequest
from service.adapters import LoRAAdapters
from service.errors import LoRADisabledError

LORA = LoRAConfig()


class _Engine:
    """AsyncEngine's adapter methods: a path ending in "bad" does not load."""

    def __init__(self, lora: LoRAConfig | None = LORA) -> None:
        self.config = SimpleNamespace(lora=lora)
        self.loaded: dict[str, LoRARequest] = {}

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        if path.endswith("bad"):
            raise InvalidRequestError("lora_path", f"{path}/adapter_config.json: missing")
        self.loaded[name] = LoRARequest(name, len(self.loaded) + 1, path, f"lora:{name}")
        return self.loaded[name]

    def unload_lora(self, name: str) -> LoRARequest:
        if name not in self.loaded:
            raise InvalidRequestError("lora_name", f"no adapter {name!r} is loaded")
        return self.loaded.pop(name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loaded.values())


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str, *_: Any) -> None:
        raise _Aborted(code, details)


def _engine(lora: LoRAConfig | None = LORA) -> tuple[_Engine, AsyncEngine]:
    engine = _Engine(lora)
    return engine, cast(AsyncEngine, engine)


def test_load_and_unload_report_the_count() -> None:
    counts: list[int] = []
    adapters = LoRAAdapters(counts.append)
    fake, engine = _engine()
    loaded = asyncio.run(adapters.load(engine, "a", "/x/a"))
    assert (loaded.lora_name, loaded.lora_path) == ("a", "/x/a")
    asyncio.run(adapters.load(engine, "b", "/x/b"))
    assert adapters.unload(engine, "a").lora_name == "a"
    assert counts == [1, 2, 1] and list(fake.loaded) == ["b"]


def test_a_server_without_lora_refuses_before_the_engine() -> None:
    fake, engine = _engine(lora=None)
    adapters = LoRAAdapters()
    with pytest.raises(LoRADisabledError, match="start it with --enable-lora"):
        asyncio.run(adapters.load(engine, "a", "/x/a"))
    with pytest.raises(LoRADisabledError):
        adapters.unload(engine, "a")
    assert not fake.loaded


@pytest.mark.parametrize(
    ("lora", "path", "code", "details"),
    [
        (None, "/x/a", grpc.StatusCode.FAILED_PRECONDITION, "serves no LoRA adapters"),
        (LoRAConfig(), "/x/bad", grpc.StatusCode.INVALID_ARGUMENT, "lora_path: /x/bad/"),
    ],
)
def test_an_rpcs_failure_is_its_status(
    lora: LoRAConfig | None, path: str, code: grpc.StatusCode, details: str
) -> None:
    _, engine = _engine(lora)
    context = cast(grpc.aio.ServicerContext, _Context())
    with pytest.raises(_Aborted) as info:
        asyncio.run(LoRAAdapters().load_or_abort(context, engine, "a", path))
    assert info.value.args[0] == code and details in info.value.args[1]
    with pytest.raises(_Aborted) as info:
        asyncio.run(LoRAAdapters().unload_or_abort(context, engine, "a"))
    assert info.value.args[0] == (
        grpc.StatusCode.FAILED_PRECONDITION if lora is None else grpc.StatusCode.INVALID_ARGUMENT
    )


def test_a_module_that_does_not_load_stops_the_start() -> None:
    counts: list[int] = []
    fake, engine = _engine()
    modules = (("a", "/x/a"), ("b", "/x/bad"))
    with pytest.raises(ConfigError) as info:
        asyncio.run(LoRAAdapters(counts.append).load_at_start(engine, modules))
    assert (
        str(info.value) == "--lora-modules b=/x/bad: lora_path: /x/bad/adapter_config.json: missing"
    )
    asyncio.run(LoRAAdapters(counts.append).load_at_start(engine, (("c", "/x/c"),)))
    assert list(fake.loaded) == ["a", "c"] and counts == [2]
