"""Which form a model's weights take in memory: `--quantization`.

* ``auto`` (the default): a GGUF model on CPU in float32 keeps its own
  blocks where the compiled kernels multiply them (Q4_0, Q4_1, Q5_0, Q8_0,
  Q4_K, Q6_K; other GGUF types, e.g. Q5_K, are expanded), since their float values are
  exactly the blocks'; anything else loads as its checkpoint stores it.
* ``gguf``: as ``auto`` for a GGUF model, and an error where it cannot be.
* ``int8``: every projection and the LM head quantized per output channel
  at load (any model, CPU, float32).
* ``bf16``: the same weights rounded to bfloat16 (half float32's bytes),
  still multiplied in float32 (CPU, float32).
* ``none``: float weights in the model's dtype (a GGUF is expanded).

``int8_activations`` makes the quantized linears round their inputs to int8
as well, as llama.cpp does (kernels/quant.py says what that costs).

The activations, norms, attention and KV cache stay in the model's dtype
(float32) whatever the weights are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engine.config import ConfigError
from engine.models.quantized_weights import Quantize
from kernels import cpu_kernels

QuantizationName = Literal["auto", "none", "gguf", "int8", "bf16"]
QUANTIZATIONS: tuple[QuantizationName, ...] = ("auto", "none", "gguf", "int8", "bf16")


@dataclass(frozen=True)
class WeightPlan:
    gguf: Path | None  # read blocks from this GGUF file, else the checkpoint
    quantize: Quantize  # quantize float weights as they load
    # Quantized linears round their inputs to int8 too (kernels/quant.py).
    int8_activations: bool = False


FLOAT_WEIGHTS = WeightPlan(gguf=None, quantize=None)


def plan_weights(
    quantization: QuantizationName,
    gguf: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    *,
    int8_activations: bool = False,
) -> WeightPlan:
    """The plan for a model whose GGUF source (if any) is `gguf`."""
    plan = _plan(quantization, gguf, dtype, device, int8_activations)
    if int8_activations and not plan.int8_activations:
        # Silently multiplying in float would hide that the option did nothing.
        raise ConfigError(
            f"int8_activations needs quantized weights, and quantization={quantization!r} "
            "loads this model with float weights: use quantization='int8', or a GGUF model "
            "with quantization='auto' or 'gguf'"
        )
    return plan


def _plan(
    quantization: QuantizationName,
    gguf: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    int8_activations: bool,
) -> WeightPlan:
    if quantization == "none":
        return FLOAT_WEIGHTS
    why_not = _why_no_kernels(dtype, device)
    if quantization == "bf16":
        if why_not:
            raise ConfigError(f"quantization='bf16' is unavailable: {why_not}")
        return WeightPlan(gguf=None, quantize="bf16")  # no int8 path for bfloat16
    if quantization == "int8":
        if why_not:
            raise ConfigError(f"quantization='int8' is unavailable: {why_not}")
        return WeightPlan(gguf=None, quantize="int8", int8_activations=int8_activations)
    if gguf is None or why_not:
        if quantization == "gguf":
            raise ConfigError(
                "quantization='gguf' is unavailable: " + (why_not or "the model is not a GGUF file")
            )
        return FLOAT_WEIGHTS
    return WeightPlan(gguf=gguf, quantize=None, int8_activations=int8_activations)


def _why_no_kernels(dtype: torch.dtype, device: torch.device) -> str:
    if device.type != "cpu":
        return f"quantized weights run on CPU only (device is {device.type})"
    if dtype != torch.float32:
        return (
            f"quantized weights compute in float32 (dtype is {str(dtype).removeprefix('torch.')})"
        )
    if cpu_kernels.load() is None:
        return "Tandem's compiled CPU kernels did not load (see the log)"
    return ""
