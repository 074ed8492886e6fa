"""The block-quantized linear kernels against torch on gguf's own dequantization.

The reference is the `gguf` package's dequantizer (llama.cpp's Python twin)
followed by F.linear in float32. The float-activation path must match it to
float32 rounding (its weights are exactly the reference's); the int8-activation
path within the bound its rounding allows: each input is off by at most
absmax(its block of 32) / 254, so output n of row m by at most
sum_b absmax(x[m, b]) / 254 * sum_{k in b} |w[n, k]|.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from kernels import cpu_kernels
from kernels.quant import (
    FLOAT_ISAS,
    ISAS,
    QuantizedWeight,
    ShardedWeight,
    available_isas,
    bf16_dot_rows,
    concat_rows,
    format_summary,
    from_gguf_rows,
    join_rows,
    quant_linear,
    quant_linear_silu,
    quantize_int8,
    to_bf16,
)

ROWS = (1, 2, 7, 64, 300)
# 203 outputs: a ragged last tile of 8. 576 inputs: the default model's width.
OUT, IN = 203, 576
_GGML = {
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q5_0": GGMLQuantizationType.Q5_0,
}


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if cpu_kernels.load() is None:
        pytest.skip("no C++ toolchain here: quantized weights are unavailable")


@functools.cache
def _weights(fmt: str, out: int = OUT, width: int = IN) -> tuple[QuantizedWeight, torch.Tensor]:
    """(the kernel's weight, the reference: gguf's float32 values, or for
    int8 the float weight it was quantized from)."""
    w = np.random.default_rng(3).standard_normal((out, width)).astype(np.float32) * 0.05
    if fmt == "int8":
        return quantize_int8(torch.from_numpy(w)), torch.from_numpy(w)
    if fmt == "bf16":
        return to_bf16(torch.from_numpy(w)), torch.from_numpy(w).bfloat16().float()
    raw = quants.quantize(w, _GGML[fmt])
    ref = quants.dequantize(raw, _GGML[fmt]).reshape(out, width)
    return from_gguf_rows(torch.from_numpy(raw), fmt, width), torch.from_numpy(ref.copy())


def int8_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far int8 activations (blocks of 32, absmax / 127 steps) may move
    x @ w.T, plus float32 rounding (also used by test_kquants)."""
    blocks = x.shape[1] // 32
    amax = x.view(x.shape[0], blocks, 32).abs().amax(-1)
    w_sums = w.abs().view(w.shape[0], blocks, 32).sum(-1)
    rounding = 1e-5 * (x.abs() @ w.abs().T)
    return (amax / 254) @ w_sums.T + rounding + 1e-6


def test_shards_of_one_tile_kind_join_and_multiply_as_one() -> None:
    q5, q5_ref = _weights("q5_0", out=64)
    q8, q8_ref = _weights("q8_0", out=OUT)  # the last shard may end inside a tile
    joined = concat_rows([q5, q8])
    assert joined is not None and joined.format == "q5_0/q8_0"
    assert (joined.out_features, joined.in_features) == (64 + OUT, IN)
    want = torch.cat([q5_ref, q8_ref])
    assert torch.equal(joined.dequantize(), want)
    x = torch.randn(7, IN)
    torch.testing.assert_close(quant_linear(x, joined, None), x @ want.T, rtol=1e-4, atol=1e-4)


def test_shards_of_other_kinds_or_ragged_tiles_do_not_join() -> None:
    assert concat_rows([_weights("q4_1", out=64)[0], _weights("q8_0", out=64)[0]]) is None
    # A shard before the last ending inside a tile would shift the next one's rows.
    assert concat_rows([_weights("q8_0", out=OUT)[0], _weights("q5_0", out=64)[0]]) is None
    narrow, wide = _weights("q8_0", out=64)[0], _weights("q8_0", out=64, width=640)[0]
    assert concat_rows([narrow, wide]) is None


@pytest.mark.parametrize("int8_activations", [False, True])
def test_shards_of_other_kinds_multiply_into_their_columns(int8_activations: bool) -> None:
    """join_rows keeps tiles of different kinds as shards (split execution):
    each writes its columns, with its part of the bias."""
    shards = [_weights(f, out=n) for f, n in (("q4_1", 64), ("q8_0", 16), ("q4_1", OUT))]
    weights = [dataclasses.replace(w, int8_activations=int8_activations) for w, _ in shards]
    joined = join_rows(weights)
    assert isinstance(joined, ShardedWeight) and joined.format == "q4_1|q8_0|q4_1"
    assert (joined.out_features, joined.in_features) == (80 + OUT, IN)
    assert joined.nbytes == sum(w.nbytes for w in weights)
    want = torch.cat([ref for _, ref in shards])
    assert torch.equal(joined.dequantize(), want)
    assert torch.equal(joined.dequantize(torch.tensor([70, 3])), want[[70, 3]])
    x, bias = torch.randn(7, IN), torch.randn(80 + OUT)
    got = quant_linear(x, joined, bias)
    parts = [quant_linear(x, w, bias[a : a + w.out_features]) for w, a in joined.columns()]
    assert torch.equal(got, torch.cat(parts, dim=1))  # each shard's own kernel call
    if not int8_activations:
        torch.testing.assert_close(got, x @ want.T + bias, rtol=1e-4, atol=1e-4)


def test_shards_of_one_weight_must_agree() -> None:
    q4, q8 = _weights("q4_1", out=64)[0], _weights("q8_0", out=64, width=640)[0]
    with pytest.raises(ValueError, match="in_features"):
        ShardedWeight((q4, q8))
    assert join_rows([q4, _weights("q4_1", out=8)[0]]).format == "q4_1"  # one kind: joined


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q8_0", "int8", "bf16"])
def test_dequantize_gives_the_reference_values(fmt: str) -> None:
    qw, ref = _weights(fmt)
    got = qw.dequantize()
    if fmt == "int8":
        # Within half a step of each row's scale (absmax / 127, float16, rounded up).
        step = ref.abs().amax(1, keepdim=True) / 127 * (1 + 2**-10)
        assert bool(((got - ref).abs() <= step / 2).all())
    else:
        assert torch.equal(got, ref)  # GGUF's blocks (and bfloat16 values) bit for bit
    rows = torch.tensor([0, 202, 7, 8])
    assert torch.equal(qw.dequantize(rows), got[rows])


def _isa(isa: str) -> str:
    """`isa` if this build has it (a test of a path the CPU lacks is skipped)."""
    if isa not in available_isas():
        pytest.skip(
            f"this build has no {isa} path (CPU: {torch.backends.cpu.get_cpu_capability()})"
        )
    return isa


@pytest.mark.parametrize("isa", FLOAT_ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q8_0", "int8", "bf16"])
def test_float_activations_match_the_reference(fmt: str, rows: int, isa: str) -> None:
    qw, _ = _weights(fmt)
    ref_w = qw.dequantize()
    torch.manual_seed(rows)
    x = torch.randn(rows, IN)
    bias = torch.randn(OUT)
    got = quant_linear(x, qw, bias, isa=_isa(isa))
    want = F.linear(x, ref_w, bias)
    dot_rows = bf16_dot_rows()
    if fmt == "bf16" and isa in ("avx512", "amx") and dot_rows is not None and rows >= dot_rows:
        # AVX512_BF16's dot products take the inputs rounded to bfloat16:
        # each off by at most 2^-9 of itself.
        bound = (x.abs() @ ref_w.abs().T) * 2**-9 * (1 + 1e-3) + 1e-5
        err = (got - want).abs()
        assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max().item():.3f}"
        assert err.max().item() > 1e-4  # ... and the rounding is really there
        return
    # float32 sums of 576 products in another order: ~1e-6 of their size.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q8_0", "int8"])
def test_int8_activations_stay_within_their_rounding(fmt: str, rows: int, isa: str) -> None:
    qw, _ = _weights(fmt)
    qw = QuantizedWeight(qw.format, qw.out_features, qw.in_features, qw.packed, True)
    ref_w = qw.dequantize()
    torch.manual_seed(rows)
    x = torch.randn(rows, IN)
    got = quant_linear(x, qw, None, isa=_isa(isa))
    want = F.linear(x, ref_w)
    err = (got - want).abs()
    bound = int8_error_bound(x, ref_w)
    assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max().item():.3f}"
    # ... and the rounding is really there (a float path would pass the bound too).
    assert err.max().item() > 1e-4


def test_int8_activations_need_integer_blocks() -> None:
    qw, _ = _weights("bf16")
    qw = QuantizedWeight(qw.format, qw.out_features, qw.in_features, qw.packed, True)
    with pytest.raises(RuntimeError, match="int8 activations need integer blocks"):
        quant_linear(torch.randn(2, IN), qw, None)


def test_int8_weights_take_inputs_of_any_width() -> None:
    """HF widths need not be multiples of 32: the blocks are zero-padded."""
    qw, ref = _weights("int8", out=17, width=100)
    x = torch.randn(5, 100)
    torch.testing.assert_close(quant_linear(x, qw, None), F.linear(x, qw.dequantize()))
    step = ref.abs().amax(1, keepdim=True) / 127 * (1 + 2**-10)
    assert bool(((qw.dequantize() - ref).abs() <= step / 2).all())


def _int8_act(fmt: str, out: int = OUT, width: int = IN) -> QuantizedWeight:
    qw, _ = _weights(fmt, out, width)
    return QuantizedWeight(qw.format, qw.out_features, qw.in_features, qw.packed, True)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    module = cpu_kernels.load()
    assert module is not None
    act = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    module.silu_mul(act, gate_up)
    return act


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_silu_fused_into_the_int8_activations(fmt: str, rows: int, isa: str) -> None:
    """The down projection computes silu(gate) * up a block at a time as it
    quantizes it: the same activation, quantized alike, as silu_mul and
    then quant_linear (bit for bit), from a strided gate_up view."""
    qw = _int8_act(fmt)
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * IN + 5) * 3)[:, : 2 * IN]
    bias = torch.randn(OUT)
    want = quant_linear(_silu_mul(gate_up), qw, bias, isa=_isa(isa))
    assert torch.equal(quant_linear_silu(gate_up, qw, bias, isa=_isa(isa)), want)


def test_silu_fused_takes_widths_that_are_not_whole_blocks() -> None:
    qw = _int8_act("int8", out=17, width=100)
    gate_up = torch.randn(7, 200) * 3
    want = quant_linear(_silu_mul(gate_up), qw, None)
    assert torch.equal(quant_linear_silu(gate_up, qw, None), want)


def test_int8_activations_ignore_what_an_earlier_call_left() -> None:
    """The quantized rows live in a per-thread buffer reused without zeroing:
    a narrow call after a wide one with large inputs must still see zero
    padding past its last input and none of the earlier rows."""
    qw = _int8_act("int8", out=17, width=100)
    x = torch.randn(5, 100)
    want = F.linear(x, qw.dequantize())
    bound = int8_error_bound(F.pad(x, (0, 28)), F.pad(qw.dequantize(), (0, 28)))
    for _ in range(2):
        quant_linear(torch.randn(300, IN) * 100, _int8_act("q8_0"), None)
        got = quant_linear(x, qw, None)
        assert bool(((got - want).abs() <= bound).all())
        quant_linear_silu(torch.randn(300, 2 * IN) * 100, _int8_act("q4_1"), None)
        assert torch.equal(quant_linear(x, qw, None), got)


def test_silu_fused_refuses_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"gate_up must be \[rows, 1152\]"):
        quant_linear_silu(torch.randn(3, IN), _int8_act("q4_1"), None)
    exact, _ = _weights("q4_1")
    with pytest.raises(ValueError, match="needs a weight with int8 activations"):
        quant_linear_silu(torch.randn(3, 2 * IN), exact, None)
    with pytest.raises(ValueError, match="isa 'sse'"):
        quant_linear_silu(torch.randn(3, 2 * IN), _int8_act("q4_1"), None, isa="sse")


@pytest.mark.parametrize("isa", FLOAT_ISAS)
def test_bf16_takes_any_width_and_strided_rows(isa: str) -> None:
    """100 inputs (zero-padded to 128), 40 rows 2 x 100 apart: past
    bf16_dot_rows() where the CPU has AVX512_BF16."""
    w = torch.randn(21, 100)
    qw = to_bf16(w)
    x = torch.randn(40, 200)[:, :100]
    got = quant_linear(x, qw, None, isa=_isa(isa))
    want = F.linear(x, w.bfloat16().float())
    bound = (x.abs() @ w.abs().T) * 2**-9 * (1 + 1e-3) + 1e-5
    assert bool(((got - want).abs() <= bound).all())


def test_strided_rows_and_empty_batches() -> None:
    qw, _ = _weights("q4_1")
    wide = torch.randn(6, 2 * IN)
    x = wide[:, :IN]  # rows 2 * IN apart
    torch.testing.assert_close(
        quant_linear(x, qw, None), F.linear(x, qw.dequantize()), rtol=1e-5, atol=2e-5
    )
    assert quant_linear(torch.empty(0, IN), qw, None).shape == (0, OUT)


def test_bad_inputs_name_what_is_wrong() -> None:
    qw, _ = _weights("q8_0")
    module = cpu_kernels.load()
    assert module is not None
    with pytest.raises(RuntimeError, match="columns"):
        quant_linear(torch.randn(2, IN + 64), qw, None)
    with pytest.raises(RuntimeError, match="bias"):
        quant_linear(torch.randn(2, IN), qw, torch.randn(OUT + 1))
    with pytest.raises(RuntimeError, match="not a supported block format"):
        module.pack_gguf_blocks(torch.zeros(8, 36, dtype=torch.uint8), 13)  # Q5_K
    with pytest.raises(RuntimeError, match="not whole blocks"):
        module.pack_gguf_blocks(torch.zeros(8, 35, dtype=torch.uint8), 8)
    with pytest.raises(RuntimeError, match="outside the weight"):
        qw.dequantize(torch.tensor([OUT + 100]))
    with pytest.raises(ValueError, match="not one the kernels take"):
        from_gguf_rows(torch.zeros(8, 36, dtype=torch.uint8), "q5_k", 32)


def test_kernels_report_their_simd_path() -> None:
    """Built with -march=native: a CPU torch runs AVX2 code on has the AVX2
    path, and one with AVX-512 VNNI (read from /proc/cpuinfo) the AVX-512 one."""
    capability = torch.backends.cpu.get_cpu_capability()
    assert ("avx2" in available_isas()) == (capability in ("AVX2", "AVX512"))
    flags = _cpu_flags()
    if flags:
        vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
        assert ("avx512" in available_isas()) == vnni
        # AMX also needs the OS's leave (Linux 5.16 on) and TANDEM_AMX != "0".
        if "amx" in available_isas():
            assert {"amx_tile", "amx_int8"} <= flags and vnni
        elif os.environ.get("TANDEM_AMX") != "0" and _kernel_version() >= (5, 16):
            assert not {"amx_tile", "amx_int8"} <= flags


def _kernel_version() -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_int8_activation_paths_agree() -> None:
    """Every path quantizes the inputs alike: they differ only in the order
    of the float additions."""
    for fmt in ("q4_1", "q8_0"):
        qw, _ = _weights(fmt)
        qw = QuantizedWeight(qw.format, qw.out_features, qw.in_features, qw.packed, True)
        x = torch.randn(9, IN)
        want = quant_linear(x, qw, None, isa="portable")
        for isa in available_isas():
            torch.testing.assert_close(
                quant_linear(x, qw, None, isa=isa), want, rtol=1e-5, atol=1e-4
            )


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_int8_activations_give_each_row_the_same_bits_at_any_batch(fmt: str) -> None:
    """Whole chunks of 64 rows take two tiles at a time on AVX-512, 8 rows
    one tile at a time: the same sums in the same order, so a row's outputs
    do not depend on the batch it came in (203 outputs: an odd tile left
    over on each thread's share)."""
    qw, _ = _weights(fmt)
    qw = QuantizedWeight(qw.format, qw.out_features, qw.in_features, qw.packed, True)
    x = torch.randn(128, IN)
    whole = quant_linear(x, qw, None)
    eights = torch.cat([quant_linear(x[i : i + 8], qw, None) for i in range(0, 128, 8)])
    assert torch.equal(whole, eights)


def test_bf16_dot_products_where_the_cpu_has_them() -> None:
    """A CPU with AVX512_BF16 (and VNNI: the avx512 level) has the path."""
    flags = _cpu_flags()
    if flags:
        assert (bf16_dot_rows() is not None) == (
            "avx512_bf16" in flags and "avx512" in available_isas()
        )


def test_unknown_isa_is_refused() -> None:
    qw, _ = _weights("q8_0")
    with pytest.raises(ValueError, match="isa 'sse'"):
        quant_linear(torch.randn(1, IN), qw, None, isa="sse")
    module = cpu_kernels.load()
    assert module is not None
    out = torch.empty(1, OUT)
    with pytest.raises(RuntimeError, match="isa 7 is not one of"):
        module.quant_linear(out, torch.randn(1, IN), qw.packed, None, False, 7)


def test_format_summary_orders_by_parameters() -> None:
    big, _ = _weights("q4_1")
    small, _ = _weights("q8_0", out=8, width=32)
    assert format_summary([small, big, torch.zeros(3, dtype=torch.float32)]) == (
        "q4_1+q8_0+float32"
    )
