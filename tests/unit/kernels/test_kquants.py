"""GGUF's Q4_K and Q6_K in the compiled kernels, against the gguf package's
dequantizer.

Their values (Q4_K: d * scale * q - dmin * min; Q6_K: d * scale * q) are
exact in float32, so the repacked tiles must dequantize to gguf's values
bit for bit, and the linear layer must give the float32 product of those
values up to float32 rounding: the kernels sum dw * sum(q x) + mw * sum(x)
per sub-block (or MKL sums the expanded values), at most `IN` + 2 roundings
deep, so output n of row m is off by at most (IN + 2) * 2^-24 * S[m, n],
where S bounds the magnitudes summed: sum_b (qmax |dw_b| + |mw_b|) *
sum_{k in b} |x_k| (qmax: 15 for Q4_K's q, 32 for Q6_K's q - 32).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import quants

from kernels import cpu_kernels
from kernels.quant import (
    FLOAT_ISAS,
    ISAS,
    QuantizedWeight,
    available_isas,
    from_gguf_rows,
    kernels,
    quant_linear,
    quant_linear_silu,
)
from tests.unit.kernels.kquant_blocks import Q4_K, Q6_K, q4_k_scales, q6_k_scales, random_rows
from tests.unit.kernels.test_quant import int8_error_bound

ROWS = (1, 2, 3, 7, 8, 64, 127, 128, 300)
OUT, IN = 203, 512  # a ragged last tile of 8; two super-blocks of 256


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if cpu_kernels.load() is None:
        pytest.skip("no C++ toolchain here: quantized weights are unavailable")


FORMATS = {"q4_k": Q4_K, "q6_k": Q6_K}


@functools.cache
def _weight(fmt: str) -> tuple[np.ndarray, QuantizedWeight, torch.Tensor]:
    """(raw rows, the kernels' weight, gguf's float32 values)."""
    raw = random_rows(FORMATS[fmt], OUT, IN, seed=5)
    ref = quants.dequantize(raw, FORMATS[fmt]).reshape(OUT, IN)
    return raw, from_gguf_rows(torch.from_numpy(raw), fmt, IN), torch.from_numpy(ref.copy())


def _isa(isa: str) -> str:
    if isa not in available_isas():
        pytest.skip(f"this build has no {isa} path")
    return isa


@pytest.mark.parametrize(("fmt", "tile_bytes"), [("q4_k", 192), ("q6_k", 320)])
def test_k_quants_dequantize_to_ggufs_values(fmt: str, tile_bytes: int) -> None:
    _, qw, ref = _weight(fmt)
    assert qw.format == fmt and qw.packed.shape == (26, IN // 32, tile_bytes)
    got = qw.dequantize()
    assert torch.equal(got, ref)
    rows = torch.tensor([0, 202, 7, 8])
    assert torch.equal(qw.dequantize(rows), ref[rows])


def _bound(x: torch.Tensor, raw: np.ndarray, fmt: str) -> torch.Tensor:
    if fmt == "q4_k":
        dw, mw = q4_k_scales(raw)
        weight = torch.from_numpy(15 * np.abs(dw) + np.abs(mw)).float()  # [OUT, sub-blocks]
    else:
        weight = torch.from_numpy(32 * np.abs(q6_k_scales(raw))).float()
    sub = IN // weight.shape[1]
    block_abs = x.abs().view(x.shape[0], -1, sub).sum(-1)  # [rows, sub-blocks]
    return (IN + 2) * 2**-24 * (block_abs @ weight.T) + 1e-7


@pytest.mark.parametrize("isa", FLOAT_ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_k_quant_linear_matches_the_float_product(fmt: str, rows: int, isa: str) -> None:
    raw, qw, ref = _weight(fmt)
    torch.manual_seed(rows)
    x = torch.randn(rows, IN)
    bias = torch.randn(OUT)
    got = quant_linear(x, qw, bias, isa=_isa(isa))
    want = torch.nn.functional.linear(x.double(), ref.double(), bias.double())
    err = (got.double() - want).abs()
    bound = _bound(x, raw, fmt).double()
    assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max().item():.3f}"


def _int8_act(fmt: str) -> QuantizedWeight:
    _, qw, _ = _weight(fmt)
    return QuantizedWeight(fmt, OUT, IN, qw.packed, int8_activations=True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_k_quants_take_int8_activations_within_rounding(fmt: str, rows: int, isa: str) -> None:
    """Q4_K's tiles are Q4's nibbles under float32 scales, Q6_K's Q8's int8s
    under a scale per half block (each half's integer sum apart): the int8
    kernels take both (each input off by up to absmax(its block of 32) /
    254)."""
    _, _, ref = _weight(fmt)
    torch.manual_seed(rows)
    x = torch.randn(rows, IN)
    got = quant_linear(x, _int8_act(fmt), None, isa=_isa(isa))
    err = (got - torch.nn.functional.linear(x, ref)).abs()
    bound = int8_error_bound(x, ref)
    assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max().item():.3f}"
    assert err.max().item() > 1e-4  # the rounding is really there


@pytest.mark.parametrize("fmt", FORMATS)
def test_k_quant_int8_paths_fuse_silu_and_keep_rows_batch_invariant(fmt: str) -> None:
    qw = _int8_act(fmt)
    torch.manual_seed(1)
    gate_up = torch.randn(9, 2 * IN) * 3
    act = torch.empty(9, IN)
    kernels().silu_mul(act, gate_up)
    x = torch.randn(128, IN)
    for isa in available_isas():
        want = quant_linear(act, qw, None, isa=isa)
        assert torch.equal(quant_linear_silu(gate_up, qw, None, isa=isa), want)
        whole = quant_linear(x, qw, None, isa=isa)
        eights = [quant_linear(x[i : i + 8], qw, None, isa=isa) for i in range(0, 128, 8)]
        assert torch.equal(whole, torch.cat(eights))


def test_k_quant_rows_must_be_whole_super_blocks() -> None:
    raw, _, _ = _weight("q4_k")
    with pytest.raises(RuntimeError, match="not whole blocks of 144"):
        from_gguf_rows(torch.from_numpy(raw[:, :200].copy()), "q4_k", 256)
    raw, _, _ = _weight("q6_k")
    with pytest.raises(RuntimeError, match="not whole blocks of 210"):
        from_gguf_rows(torch.from_numpy(raw[:, :300].copy()), "q6_k", 256)
