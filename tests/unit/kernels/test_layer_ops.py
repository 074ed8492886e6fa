"""The compiled RMSNorm / SiLU-and-mul / RoPE / small linear against
transformers' recipes (the torch ops), on the layouts the decoder hands them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import backend, cpu_kernels, layer_ops
from kernels.backend import select_layer_ops
from kernels.layer_ops import (
    PACKED_LINEAR_MAX_ROWS,
    SMALL_LINEAR_ROWS,
    TORCH_OPS,
    LayerOps,
)

ROWS = [1, 3, 17, 200]  # one decode, a few, and enough to split across threads


@pytest.fixture(scope="module")
def compiled() -> LayerOps:
    ops = select_layer_ops(torch.float32, torch.device("cpu"))
    if ops.name != "compiled":
        pytest.skip("no C++ toolchain here: the torch ops are used instead")
    return ops


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm(compiled: LayerOps, rows: int) -> None:
    x = torch.randn(rows, 576) * 3
    w = torch.randn(576)
    got = compiled.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, TORCH_OPS.rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_updates_the_residual(compiled: LayerOps, rows: int) -> None:
    residual, delta, w = torch.randn(rows, 64), torch.randn(rows, 64), torch.randn(64)
    want_residual = residual.clone()
    want = TORCH_OPS.add_rms_norm(want_residual, delta, w, 1e-6)
    got = compiled.add_rms_norm(residual, delta, w, 1e-6)
    torch.testing.assert_close(residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [96, 100])  # whole vectors of 16; a masked last one
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(compiled: LayerOps, rows: int, width: int) -> None:
    gate_up = torch.randn(rows, 2 * width) * 4
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # exp overflow on both sides
    want = TORCH_OPS.silu_mul(gate_up.clone())
    got = compiled.silu_mul(gate_up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_on_a_strided_view_of_the_qkv_output(compiled: LayerOps, head_dim: int) -> None:
    # The decoder rotates heads [:, :h + hkv] of the fused qkv output in place
    # and leaves the v heads alone.
    rows, heads, v_heads, max_pos = 9, 5, 2, 512
    half = head_dim // 2
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(half))
    cos_cache, sin_cache = angles.cos(), angles.sin()
    positions = torch.randint(0, max_pos, (rows,))
    qkv = torch.randn(rows, heads + v_heads, head_dim)
    want = qkv.clone()
    TORCH_OPS.rope_(want[:, :heads], TORCH_OPS.rope_tables(cos_cache, sin_cache, positions))
    compiled.rope_(qkv[:, :heads], compiled.rope_tables(cos_cache, sin_cache, positions))
    torch.testing.assert_close(qkv, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, heads:], want[:, heads:], atol=0, rtol=0)


def test_rope_rejects_a_position_past_the_table(compiled: LayerOps) -> None:
    table = torch.zeros(8, 32)
    x = torch.randn(2, 1, 64)
    with pytest.raises(RuntimeError, match="position 8 outside the RoPE table"):
        compiled.rope_(x, compiled.rope_tables(table, table, torch.tensor([0, 8])))


def test_torch_ops_off_cpu_or_float32(monkeypatch) -> None:
    assert select_layer_ops(torch.bfloat16, torch.device("cpu")) is TORCH_OPS
    assert select_layer_ops(torch.float32, torch.device("meta")) is TORCH_OPS
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    assert backend.select_layer_ops(torch.float32, torch.device("cpu")) is TORCH_OPS


_LINEAR_ROWS = [1, 2, 5, SMALL_LINEAR_ROWS, SMALL_LINEAR_ROWS + 1, 13, 64, 100]
_LINEAR_ROWS += [PACKED_LINEAR_MAX_ROWS, PACKED_LINEAR_MAX_ROWS + 1]


@pytest.mark.parametrize("rows", _LINEAR_ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("pack", [False, True])
def test_linear(compiled: LayerOps, rows: int, bias: bool, pack: bool) -> None:
    # 3073 outputs: not a multiple of the kernel's four-row unroll.
    x, w = torch.randn(rows, 576), torch.randn(3073, 576)
    b = torch.randn(3073) if bias else None
    packed = compiled.pack_linear(w) if pack else None
    torch.testing.assert_close(
        compiled.linear(x, w, b, packed), F.linear(x, w, b), atol=1e-4, rtol=1e-5
    )


@pytest.mark.parametrize("in_features", [7, 100, 577])
# 1 row, then blocks of 3, 2 and 3 + 1 rows (the AVX2 kernel's row blocks).
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_small_linear_with_a_ragged_input_width(
    compiled: LayerOps, rows: int, in_features: int
) -> None:
    # Widths that are not a multiple of the kernels' 16- or 8-lane loads:
    # the tail must count its columns exactly once.
    x, w, b = torch.randn(rows, in_features), torch.randn(45, in_features), torch.randn(45)
    torch.testing.assert_close(
        compiled.linear(x, w, b, None), F.linear(x, w, b), atol=1e-4, rtol=1e-5
    )


@pytest.mark.parametrize("rows", [3, 40])
def test_linear_on_a_strided_input(compiled: LayerOps, rows: int) -> None:
    x = torch.randn(rows, 2 * 96)[:, 96:]  # e.g. the up half of gate_up
    w = torch.randn(40, 96)
    packed = compiled.pack_linear(w)
    torch.testing.assert_close(
        compiled.linear(x, w, None, packed), F.linear(x, w), atol=1e-4, rtol=1e-5
    )


def test_packing_is_skipped_where_it_does_not_apply(compiled: LayerOps) -> None:
    assert TORCH_OPS.pack_linear(torch.randn(8, 8)) is None
    assert compiled.pack_linear(torch.randn(8, 8, dtype=torch.bfloat16)) is None


def test_packing_is_refused_when_mkl_disagrees(compiled: LayerOps, monkeypatch) -> None:
    # A packed layout that gave different numbers for another row count
    # must fall back to plain BLAS rather than serve wrong logits.
    monkeypatch.setattr(
        layer_ops, "_packed_linear", lambda x, packed, weight, bias: F.linear(x, weight) + 1
    )
    assert compiled.pack_linear(torch.randn(32, 16)) is None


@pytest.mark.skipif(not layer_ops.mkl_packing_available(), reason="torch built without MKL")
def test_mkl_packs_a_float32_weight() -> None:
    assert layer_ops.mkl_pack_linear(torch.randn(32, 16)) is not None
