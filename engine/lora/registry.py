"""The front door's list of loaded adapters, by name.

Requests name an adapter; the registry turns the name into the
``LoRARequest`` the engine schedules by, or refuses it naming the loaded
ones. Loading reads and checks the adapter's files here, before the engine
thread sees anything (an adapter that would fail mid-step is refused at
load). Unloading takes the name away at once, so no new request can use it;
the engine keeps the weights until the requests already running under it
finish (``EngineCore.remove_lora``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

from engine.config import LoRAConfig
from engine.errors import InvalidRequestError
from engine.lora.adapter import LoRAAdapter, LoRAAdapterError, read_adapter
from engine.lora.request import LoRARequest
from engine.models.spec import ModelSpec

MAX_NAME_LENGTH = 256


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, spec: ModelSpec | None) -> None:
        """``config`` (or ``spec``) None: LoRA is off, every adapter refused."""
        self.config = config if spec is not None else None
        self.spec = spec
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def _require_enabled(self, field: str) -> LoRAConfig:
        if self.config is None:
            raise InvalidRequestError(
                field, "this server serves no LoRA adapters (start it with --enable-lora)"
            )
        return self.config

    def check_new_name(self, name: str) -> None:
        """Raises unless ``name`` could be loaded now."""
        self._require_enabled("lora_name")
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LENGTH:
            raise InvalidRequestError(
                "lora_name", f"must be a non-empty name of at most {MAX_NAME_LENGTH} characters"
            )
        if name in self._by_name:
            raise InvalidRequestError(
                "lora_name", f"an adapter named {name!r} is already loaded (unload it first)"
            )

    def read(self, name: str, path: str) -> tuple[LoRARequest, LoRAAdapter]:
        """Reads and checks the adapter at ``path`` (slow: file I/O; safe off
        the loop's thread, it touches no registry state but the id counter).
        Errors name the file and key at fault (field ``lora_path``)."""
        config = self._require_enabled("lora_path")
        assert self.spec is not None  # with a config, there is one
        try:
            adapter = read_adapter(path, self.spec, config.max_lora_rank)
        except LoRAAdapterError as e:
            raise InvalidRequestError("lora_path", str(e)) from None
        request = LoRARequest(
            lora_name=name,
            lora_int_id=next(self._ids),
            lora_path=str(Path(path).resolve()),
            cache_key=f"lora:{adapter.digest[:32]}",
            rank=adapter.rank,
        )
        return request, adapter

    def add(self, request: LoRARequest) -> None:
        self.check_new_name(request.lora_name)
        self._by_name[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        """Takes ``name`` away; raises naming the loaded ones if unknown."""
        request = self.resolve(name, field="lora_name")
        assert request is not None
        del self._by_name[name]
        return request

    def resolve(self, name: str | None, field: str = "lora") -> LoRARequest | None:
        """The adapter a request names (None, or "": the base model)."""
        if not name:
            return None
        self._require_enabled(field)
        request = self._by_name.get(name)
        if request is None:
            raise InvalidRequestError(
                field, f"unknown LoRA adapter {name!r}: loaded are {sorted(self._by_name)}"
            )
        return request

    def loaded(self) -> list[LoRARequest]:
        return sorted(self._by_name.values(), key=lambda r: r.lora_name)
