"""A gated MLP in one pass on AMX tiles (kernels/csrc/amx_mlp.cpp amx_mlp)
against float64 over the values the kernel rounds to (x, the weights' and
the activation's bfloat16 values), and against the chunked path it replaces
(gate_up by quant_linear, then quant_linear_silu); and the model's MLP
taking it from the threshold on."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from kernels.quant import (
    QuantizedWeight,
    amx_bf16_rows,
    amx_mlp,
    amx_mlp_applies,
    from_gguf_rows,
    quant_linear,
    quant_linear_silu,
    set_amx_bf16_rows,
)

# Widths that are not whole 64-column panels nor whole 32-wide blocks of I.
HIDDEN, INTER = 72, 80
THRESHOLD = 256  # low, so the tests stay small


@pytest.fixture(autouse=True)
def low_threshold() -> Iterator[None]:
    default = amx_bf16_rows()
    if default is None:
        pytest.skip("no AMX-BF16 here: the MLP takes the chunked int8 path")
    set_amx_bf16_rows(THRESHOLD)
    yield
    set_amx_bf16_rows(default)


def _weight(out: int, width: int, fmt: str, seed: int) -> QuantizedWeight:
    w = np.random.default_rng(seed).standard_normal((out, width)).astype(np.float32) * 0.1
    padded = -width % 32  # GGUF rows are whole blocks; the kernels take the first `width`
    raw = quants.quantize(np.pad(w, ((0, 0), (0, padded))), GGMLQuantizationType[fmt.upper()])
    return from_gguf_rows(torch.from_numpy(raw), fmt, width, True)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().double()


def _reference(
    x: torch.Tensor,
    gate_up: QuantizedWeight,
    down: QuantizedWeight,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    act: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 result over the kernel's rounded inputs, and a bound on
    what float32 sums of bfloat16 products add (the activation's own
    rounding is taken from the float32 gate_up the kernel computes)."""
    h = (x.bfloat16().float() @ gate_up.dequantize().bfloat16().float().t()).double()
    if b1 is not None:
        h += b1.double()
    gate, up = h.chunk(2, dim=-1)
    fn = F.silu if act == "silu" else lambda g: F.gelu(g, approximate="tanh")
    a = fn(gate) * up
    w2 = _bf16(down.dequantize())
    exact = _bf16(a.float()) @ w2.t()
    if b2 is not None:
        exact += b2.double()
    # The activation within 2^-8 of itself (its float32 inputs differ from
    # the float64 ones by float32 sums' error; one bfloat16 rounding more),
    # then float32 sums over INTER terms.
    magnitude = a.abs() @ w2.abs().t()
    return exact, (2.0**-7 + INTER * 2.0**-23) * magnitude + 1e-6


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [THRESHOLD, 300, 777])
def test_against_float64(act: str, rows: int) -> None:
    gate_up, down = _weight(2 * INTER, HIDDEN, "q4_1", 1), _weight(HIDDEN, INTER, "q8_0", 2)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=gen)
    b1, b2 = torch.randn(2 * INTER, generator=gen), torch.randn(HIDDEN, generator=gen)
    got = amx_mlp(x, gate_up, down, b1, b2, act)
    exact, bound = _reference(x, gate_up, down, b1, b2, act)
    assert got.shape == (rows, HIDDEN)
    assert bool(((got.double() - exact).abs() <= bound).all())
    # Without biases too (their absence is not a zero bias read from nowhere).
    exact, bound = _reference(x, gate_up, down, None, None, act)
    got = amx_mlp(x, gate_up, down, None, None, act)
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_equals_the_chunked_path_it_replaces() -> None:
    """The same roundings as quant_linear then quant_linear_silu at these
    rows (both on AMX tiles): only the order of float32 sums differs."""
    gate_up, down = _weight(2 * INTER, HIDDEN, "q4_0", 3), _weight(HIDDEN, INTER, "q5_0", 4)
    x = torch.randn(600, HIDDEN, generator=torch.Generator().manual_seed(5))
    fused = amx_mlp(x, gate_up, down, None, None, "silu")
    chunked = quant_linear_silu(quant_linear(x, gate_up, None), down, None)
    torch.testing.assert_close(fused, chunked, rtol=2e-2, atol=2e-3)


def test_refusals_name_what_is_wrong() -> None:
    gate_up, down = _weight(2 * INTER, HIDDEN, "q4_1", 1), _weight(HIDDEN, INTER, "q8_0", 2)
    x = torch.randn(THRESHOLD, HIDDEN)
    with pytest.raises(ValueError, match="activation must be one of"):
        amx_mlp(x, gate_up, down, None, None, "relu")
    with pytest.raises(ValueError, match="do not chain"):
        amx_mlp(x, down, gate_up, None, None, "silu")
    with pytest.raises(ValueError, match="does not take 255 rows"):
        amx_mlp(x[:255], gate_up, down, None, None, "silu")
    assert amx_mlp_applies(THRESHOLD, gate_up, down)
    assert not amx_mlp_applies(THRESHOLD - 1, gate_up, down)
    exact_weight = _weight(HIDDEN, INTER, "q8_0", 2)
    float_inputs = QuantizedWeight(
        exact_weight.format, exact_weight.out_features, exact_weight.in_features,
        exact_weight.packed, int8_activations=False,
    )  # fmt: skip
    assert not amx_mlp_applies(THRESHOLD, gate_up, float_inputs)
