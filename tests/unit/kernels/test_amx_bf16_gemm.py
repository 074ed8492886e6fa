"""The int8 path's many-row calls as bfloat16 GEMMs on AMX tiles
(kernels/csrc/quant_gemm.cpp amx_bf16_gemm), against float64 products of
the weights' exact values, within what bfloat16 rounding allows: inputs and
expanded weights each within 2^-9 of themselves, float32 sums written as
they are."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels.quant import (
    QuantizedWeight,
    amx_bf16_rows,
    from_gguf_rows,
    join_rows,
    quant_linear,
    quant_linear_silu,
    quantize_int8,
    set_amx_bf16_rows,
)
from tests.unit.kernels.kquant_blocks import Q6_K, random_rows

OUT, WIDTH = 203, 96  # a last tile of 3 outputs


@pytest.fixture(autouse=True)
def every_call_takes_it() -> Iterator[None]:
    default = amx_bf16_rows()
    if default is None:
        pytest.skip("no AMX-BF16 here: the int8 kernels take every call")
    set_amx_bf16_rows(1)
    yield
    set_amx_bf16_rows(default)


def _weight(fmt: str, out: int = OUT, width: int = WIDTH) -> QuantizedWeight:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((out, width)).astype(np.float32) * 0.05
    if fmt == "int8":
        return quantize_int8(torch.from_numpy(w), int8_activations=True)
    if fmt == "q6_k":
        rows = random_rows(Q6_K, out, width, seed=3)
        return from_gguf_rows(torch.from_numpy(rows), fmt, width, True)
    raw = quants.quantize(w, GGMLQuantizationType[fmt.upper()])
    return from_gguf_rows(torch.from_numpy(raw), fmt, width, True)


def _check(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    exact = x.double() @ weight.double().t()
    if bias is not None:
        exact += bias.double()
    # Each product's two factors within 2^-9 each, the sums in float32 (K
    # terms).
    magnitude = x.double().abs() @ weight.double().abs().t()
    bound = (2.0**-8 + 2.0**-17 + x.shape[1] * 2.0**-24) * magnitude
    assert bool(((got.double() - exact).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q5_0", "int8"])
@pytest.mark.parametrize("rows", [1, 33, 300])
def test_within_bfloat16_rounding(fmt: str, rows: int) -> None:
    weight = _weight(fmt)
    x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(OUT)
    _check(quant_linear(x, weight, bias), x, weight.dequantize(), bias)


def test_k_quants_and_shards() -> None:
    q6 = _weight("q6_k", OUT, 256)
    q8 = _weight("q8_0", 64, 256)
    x = torch.randn(40, 256)
    _check(quant_linear(x, q6, None), x, q6.dequantize(), None)
    joined = join_rows([q8, q6])
    _check(quant_linear(x, joined, None), x, joined.dequantize(), None)


def test_silu_down_projection() -> None:
    weight = _weight("q4_1")
    gate_up = torch.randn(50, 2 * WIDTH)
    act = torch.nn.functional.silu(gate_up[:, :WIDTH]) * gate_up[:, WIDTH:]
    _check(quant_linear_silu(gate_up, weight, None), act, weight.dequantize(), None)


def test_below_the_threshold_the_int8_kernels_answer() -> None:
    weight = _weight("q8_0")
    x = torch.randn(64, WIDTH)
    on = quant_linear(x, weight, None)
    set_amx_bf16_rows(65)
    below = quant_linear(x, weight, None)
    set_amx_bf16_rows(0)
    off = quant_linear(x, weight, None)
    assert torch.equal(below, off)
    assert not torch.equal(on, off)  # the two paths round differently
    with pytest.raises(RuntimeError, match="rows must be >= 0"):
        set_amx_bf16_rows(-1)
