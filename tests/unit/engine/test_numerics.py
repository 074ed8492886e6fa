"""resolve_numerics: the fast path (int8 activations, bfloat16 KV cache) is
the default only for GGUF blocks on CPU; ``exact`` and explicit settings
win over it; ``exact`` beside a lossy explicit setting is refused."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import ConfigError, ModelConfig
from engine.numerics import Numerics, resolve_numerics


def _resolve(gguf_blocks: bool, **settings: Any) -> Numerics:
    return resolve_numerics(ModelConfig(**settings), gguf_blocks)


def test_gguf_blocks_default_to_the_fast_path() -> None:
    got = _resolve(True)
    assert got == Numerics(int8_activations=True, kv_cache_dtype="bfloat16", path="fast (default)")
    assert got.describe() == "fast (default): int8 activations, bfloat16 KV cache"


def test_exact_restores_the_exact_path() -> None:
    got = _resolve(True, exact=True)
    assert got == Numerics(int8_activations=False, kv_cache_dtype="float32", path="exact")
    assert got.activations == "float"
    # Saying the exact path's values explicitly beside it is no contradiction.
    assert _resolve(True, exact=True, int8_activations=False, kv_cache_dtype="float32") == got


@pytest.mark.parametrize(
    ("settings", "want"),
    [
        ({"int8_activations": False}, Numerics(False, "bfloat16", "fast")),
        ({"kv_cache_dtype": "float32"}, Numerics(True, "float32", "fast")),
        (
            {"int8_activations": False, "kv_cache_dtype": "float32"},
            Numerics(False, "float32", "exact"),
        ),
        ({"kv_cache_dtype": "float16"}, Numerics(True, "float16", "fast")),
    ],
)
def test_explicit_settings_win_over_the_default(settings: dict[str, Any], want: Numerics) -> None:
    assert _resolve(True, **settings) == want


@pytest.mark.parametrize(
    ("settings", "want"),
    [
        ({}, Numerics(False, "float32", "exact")),
        ({"dtype": "bfloat16"}, Numerics(False, "bfloat16", "exact")),
        ({"kv_cache_dtype": "bfloat16"}, Numerics(False, "bfloat16", "fast")),
        # int8 weights quantized at load: int8 activations stay opt-in.
        ({"quantization": "int8", "int8_activations": True}, Numerics(True, "float32", "fast")),
    ],
)
def test_elsewhere_unset_means_what_it_always_did(settings: dict[str, Any], want: Numerics) -> None:
    """Float weights, CUDA, int8 weights: not GGUF blocks on CPU."""
    assert _resolve(False, **settings) == want


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"int8_activations": True}, "int8_activations=True"),
        ({"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype='bfloat16'"),
        ({"dtype": "bfloat16", "kv_cache_dtype": "float32"}, "kv_cache_dtype='float32'"),
    ],
)
def test_exact_beside_a_lossy_setting_names_the_field(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field} is invalid: expected .* with exact=True"):
        ModelConfig(exact=True, **settings)


def test_fp8_is_vllms_alias_of_fp8_e4m3() -> None:
    for name in ("fp8", "fp8_e4m3"):
        numerics = resolve_numerics(ModelConfig(kv_cache_dtype=name), gguf_blocks=False)
        assert numerics.kv_cache_dtype == "fp8_e4m3"
        assert numerics.path == "fast"
