"""EngineCore's start: a bad connector config stops it before the model loads."""

from __future__ import annotations

from typing import Any

import pytest

from engine import core
from engine.config import ConfigError, EngineConfig, KVTransferConfig


def test_a_misspelled_connector_option_stops_the_start_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_model(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model loaded before the connector config was checked")

    monkeypatch.setattr(core, "Worker", no_model)
    kv = KVTransferConfig("shm", "kv_both", {"capacity_byts": 1 << 20})
    with pytest.raises(ConfigError, match=r"'shm' connector has unknown key 'capacity_byts' "):
        core.EngineCore(EngineConfig(kv_transfer=kv))
