"""Settings the worker refuses once it knows the device and backend."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.core import EngineCore


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_an_fp8_cache_on_cpu_is_refused_by_name(name: str) -> None:
    config = EngineConfig(model=ModelConfig(kv_cache_dtype=name, device="cpu"))
    with pytest.raises(ConfigError, match=rf"kv_cache_dtype='{name}' needs the Triton"):
        EngineCore(config)
