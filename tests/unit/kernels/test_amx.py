"""The int8 path's AMX kernels (kernels/csrc/quant_linear_amx.cpp) against
the same calls on VNNI: the same integer sums, scaled and added in the same
order, so the same floats, bit for bit (the VNNI kernels themselves are
checked against gguf's dequantizer in test_quant.py and test_kquants.py,
which also run every test at the "amx" level where the CPU has it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels.quant import (
    ISAS,
    QuantizedWeight,
    available_isas,
    cap_isa,
    from_gguf_rows,
    quant_linear,
    quant_linear_silu,
    quantize_int8,
)
from tests.unit.kernels.kquant_blocks import Q6_K, random_rows

# 203 outputs: 26 tiles of 8, so the last group of 4 tiles has 2 and the
# last tile 3 outputs. 33 and 100 rows: tiles of 32 rows with padding.
OUT = 203
ROWS = (32, 33, 100, 300)


@pytest.fixture(scope="module", autouse=True)
def _amx() -> None:
    if "amx" not in available_isas():
        pytest.skip(f"no amx path here (paths: {', '.join(available_isas())})")


def _weight(fmt: str, width: int) -> QuantizedWeight:
    rng = np.random.default_rng(11)
    if fmt == "q6_k":
        qw = from_gguf_rows(torch.from_numpy(random_rows(Q6_K, OUT, width, seed=11)), fmt, width)
    elif fmt == "int8":
        qw = quantize_int8(torch.from_numpy(rng.standard_normal((OUT, width)).astype(np.float32)))
    else:
        w = rng.standard_normal((OUT, width)).astype(np.float32) * 0.05
        ggml = {"q8_0": GGMLQuantizationType.Q8_0, "q5_0": GGMLQuantizationType.Q5_0}[fmt]
        qw = from_gguf_rows(torch.from_numpy(quants.quantize(w, ggml)), fmt, width)
    return QuantizedWeight(qw.format, OUT, width, qw.packed, int8_activations=True)


# int8 at 600 inputs: a last block of 24 (zero-padded in the tiles).
WIDTHS = [("q8_0", 576), ("q5_0", 576), ("int8", 600), ("q6_k", 512)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("fmt", "width"), WIDTHS)
def test_amx_equals_vnni_bit_for_bit(fmt: str, width: int, rows: int) -> None:
    qw = _weight(fmt, width)
    torch.manual_seed(rows)
    x = torch.randn(rows, width) * 2
    bias = torch.randn(OUT)
    want = quant_linear(x, qw, bias, isa="avx512")
    got = quant_linear(x, qw, bias, isa="amx")
    assert torch.equal(got, want)
    # ... and the call did compute something (not a copy of zeros).
    assert got.abs().max().item() > 0.1


def test_amx_takes_the_fused_activation_and_keeps_rows_batch_invariant() -> None:
    qw = _weight("q8_0", 576)
    torch.manual_seed(0)
    gate_up = torch.randn(64, 2 * 576) * 3
    want = quant_linear_silu(gate_up, qw, None, isa="avx512")
    assert torch.equal(quant_linear_silu(gate_up, qw, None, isa="amx"), want)
    # 64 rows run on tiles, 8 rows on VNNI: a row's outputs do not depend
    # on the batch it came in.
    x = torch.randn(64, 576)
    whole = quant_linear(x, qw, None, isa="amx")
    eights = torch.cat([quant_linear(x[i : i + 8], qw, None, isa="amx") for i in range(0, 64, 8)])
    assert torch.equal(whole, eights)


def test_cap_isa_limits_every_later_call() -> None:
    try:
        cap_isa("avx512")
        assert available_isas() == ISAS[:3]
    finally:
        cap_isa(ISAS[-1])
    assert available_isas() == ISAS
    with pytest.raises(ValueError, match="isa 'sse'"):
        cap_isa("sse")


def test_tandem_amx_0_keeps_a_process_on_vnni() -> None:
    code = "from kernels.quant import available_isas; print(','.join(available_isas()))"
    env = {**os.environ, "TANDEM_AMX": "0"}
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().split(",") == list(ISAS[:3])
