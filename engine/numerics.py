"""Which numerics a model runs with: ``ModelConfig``'s ``exact``,
``int8_activations`` and ``kv_cache_dtype`` resolved once the weights'
form in memory is known (engine/models/weight_plan.py).

Where the weights run as GGUF blocks on the CPU (the default model's
q4_1+q8_0), the fast path is the default: the quantized linears round their
inputs to int8, as llama.cpp does, and the KV cache holds bfloat16 (the
README gives what that costs in accuracy). ``exact`` restores the bit-exact
path (float activations, the cache in the model's dtype), and an explicit
``int8_activations`` or ``kv_cache_dtype`` wins over the default. Elsewhere
(float weights, CUDA) an unset setting means what it always did: float
activations and a cache in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.config import ModelConfig

PathName = Literal["exact", "fast (default)", "fast"]


@dataclass(frozen=True)
class Numerics:
    """The resolved settings. ``path``: "exact" (float activations, the KV
    cache in the model's dtype: nothing rounded beyond the weights),
    "fast (default)" (the fast path by default), or "fast" (a lossy setting
    given explicitly)."""

    int8_activations: bool
    kv_cache_dtype: str  # 'float32', 'bfloat16', 'float16', 'int8' or 'fp8_e4m3'
    path: PathName

    @property
    def activations(self) -> str:
        """What the quantized linears' inputs are: 'int8' or 'float'."""
        return "int8" if self.int8_activations else "float"

    def describe(self) -> str:
        """One line for logs and ``tandem status``."""
        return f"{self.path}: {self.activations} activations, {self.kv_cache_dtype} KV cache"


EXACT_FLOAT32 = Numerics(int8_activations=False, kv_cache_dtype="float32", path="exact")


def resolve_numerics(config: ModelConfig, gguf_blocks: bool) -> Numerics:
    """``config``'s numerics for weights that run as GGUF blocks on the CPU
    (``gguf_blocks``: WeightPlan.gguf is set) or not.

    An unset ``int8_activations`` (None) and ``kv_cache_dtype='auto'`` take
    the fast path's values (int8, bfloat16) where the weights are GGUF
    blocks and ``exact`` is off, else float activations and the model's
    dtype. ModelConfig already refused ``exact`` beside a lossy explicit
    setting."""
    fast = gguf_blocks and not config.exact
    int8 = fast if config.int8_activations is None else config.int8_activations
    kv = config.kv_cache_dtype
    if kv == "auto":
        kv = "bfloat16" if fast else config.dtype
    elif kv == "fp8":
        kv = "fp8_e4m3"  # vLLM's alias: one name in block keys and reports
    return Numerics(int8, kv, _path_name(config, int8, kv, fast))


def _path_name(config: ModelConfig, int8: bool, kv: str, fast: bool) -> PathName:
    if not int8 and kv == config.dtype:
        return "exact"
    unset = config.int8_activations is None and config.kv_cache_dtype == "auto"
    return "fast (default)" if fast and unset else "fast"
