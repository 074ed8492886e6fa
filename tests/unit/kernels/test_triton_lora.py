"""The Triton LoRA kernels against `kernels.lora.lora_torch`, in Triton's CPU
interpreter.

As in test_triton_kernels.py: TRITON_INTERPRET must be set before triton is
first imported, and another test may already have imported it in this
process, so the comparisons run in one child interpreter that prints a JSON
report, and a second child compiles the kernels for sm_90 without a GPU,
which catches what the interpreter is lenient about (tl.dot operand types,
loop-carried types, constexpr misuse). The two children run side by side.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kernels.lora import LoRABatch, LoRASegment
from tests.unit.kernels.triton_child import (
    child_result,
    compile_sm90,
    ptxas_available,
    start_child,
)

# Seconds each (the real model, the Triton interpreter, child processes or
# Helm renders): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow


@dataclasses.dataclass(frozen=True)
class LoRACase:
    name: str
    num_tokens: int
    in_features: int
    out_features: int
    rank: int
    segments: tuple[tuple[int, int, int], ...]  # (start, end, slot)
    num_slots: int = 3
    dtype: torch.dtype = torch.float32
    # Max error relative to the largest delta the adapters add.
    tol: float = 1e-4
    splits: int | None = None  # forced shrink splits; None = the launcher's choice
    # x and y as column slices of wider (fused-projection) tensors.
    strided: bool = False
    # NaN where the kernels must never read (base rows of x, unused slots'
    # weights), and -0.0 in base rows of y, which adding 0.0 would turn to +0.0.
    poisoned: bool = False


CASES = (
    LoRACase("one-adapter", 20, 64, 96, 16, ((0, 20, 1),)),
    LoRACase(
        "base-rows-around",
        70,
        128,
        80,
        8,
        ((3, 10, 0), (15, 31, 1), (31, 52, 2)),
        num_slots=4,
        poisoned=True,
    ),
    # in/out not multiples of any tile: ragged last K step and output tile.
    LoRACase("slots-out-of-order", 40, 100, 72, 16, ((0, 17, 2), (25, 40, 0))),
    LoRACase("rank48-576-960", 40, 576, 960, 48, ((2, 19, 1), (19, 40, 0))),
    LoRACase("rank48-1536-576", 24, 1536, 576, 48, ((0, 9, 2), (12, 24, 1))),
    LoRACase("decode-t1", 1, 576, 960, 48, ((0, 1, 2),)),
    # Short decode segments: one row tile holds several slots.
    LoRACase(
        "mixed-tile",
        13,
        160,
        200,
        24,
        ((0, 2, 3), (2, 3, 0), (4, 7, 1), (7, 8, 3), (10, 13, 2)),
        num_slots=5,
        poisoned=True,
    ),
    # 19 K steps over 3 splits: 7, 7 and a ragged 5.
    LoRACase("split-k", 30, 600, 320, 48, ((0, 11, 0), (14, 30, 2)), splits=3),
    LoRACase("strided", 33, 576, 960, 48, ((1, 20, 2), (24, 33, 1)), strided=True),
    LoRACase("bf16", 40, 576, 960, 48, ((2, 19, 1), (19, 40, 0)), dtype=torch.bfloat16, tol=3e-2),
    LoRACase(
        "fp16-split",
        24,
        1536,
        576,
        96,
        ((0, 9, 2), (12, 24, 1)),
        dtype=torch.float16,
        tol=5e-3,
        splits=2,
    ),
)


def _batch(case: LoRACase) -> LoRABatch:
    return LoRABatch([LoRASegment(*seg) for seg in case.segments], case.num_tokens)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _lora_errors(case: LoRACase) -> dict[str, float]:
    """Runs one case; returns the kernel's error relative to the delta and how
    many elements it changed that it must not have."""
    from kernels.lora import lora_torch
    from kernels.triton_lora import lora_triton

    gen = torch.Generator().manual_seed(7)
    tokens, fan_in, fan_out, rank = (
        case.num_tokens,
        case.in_features,
        case.out_features,
        case.rank,
    )

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(case.dtype)

    x = randn(tokens, fan_in)
    y = randn(tokens, fan_out)
    a = randn(case.num_slots, rank, fan_in, scale=fan_in**-0.5)
    b = randn(case.num_slots, fan_out, rank, scale=rank**-0.5)
    batch = _batch(case)
    lora_rows = torch.zeros(tokens, dtype=torch.bool)
    for seg in batch.segments:
        lora_rows[seg.start : seg.end] = True
    if case.poisoned:
        x[~lora_rows] = float("nan")
        y[~lora_rows, ::2] = -0.0
        unused = sorted(set(range(case.num_slots)) - {seg.slot for seg in batch.segments})
        a[unused] = float("nan")
        b[unused] = float("nan")

    want = y.clone()
    lora_torch(want, x, a, b, batch)

    if case.strided:
        # Column slices of wider tensors: row strides past the row length.
        wide_x = torch.cat([randn(tokens, 8), x, randn(tokens, 40)], dim=1)
        wide_y = torch.cat([randn(tokens, 24), y, randn(tokens, 8)], dim=1)
        x_view, y_view = wide_x[:, 8 : 8 + fan_in], wide_y[:, 24 : 24 + fan_out]
        wide_before = wide_y.clone()
        lora_triton(y_view, x_view, a, b, batch, num_splits=case.splits)
        got = y_view
        outside = torch.ones_like(wide_y, dtype=torch.bool)
        outside[:, 24 : 24 + fan_out] = False
        # Columns outside the view must be untouched too.
        stray = int((wide_y[outside] != wide_before[outside]).sum().item())
    else:
        got = y.clone()
        lora_triton(got, x, a, b, batch, num_splits=case.splits)
        stray = 0

    delta = (want.float() - y.float())[lora_rows].abs().max().item()
    err = (got.float() - want.float())[lora_rows].abs().max().item() / delta
    # Base rows must come back bit-identical.
    base_changed = int((_bits(got[~lora_rows]) != _bits(y[~lora_rows])).sum().item())
    return {"err": err, "base_changed": base_changed + stray}


def _rejections() -> list[str]:
    """Operands the launcher must refuse rather than misread."""
    from kernels.triton_lora import lora_triton

    x, y = torch.zeros(4, 32), torch.zeros(4, 16)
    a, b = torch.zeros(2, 8, 32), torch.zeros(2, 16, 8)
    batch = LoRABatch([LoRASegment(0, 4, 1)], 4)
    bad = {
        "b-rank": (y, x, a, torch.zeros(2, 16, 4), batch),
        "a-dtype": (y, x, a.half(), b, batch),
        "num-tokens": (y, x, a, b, LoRABatch([LoRASegment(0, 3, 1)], 3)),
        "slot-range": (y, x, a, b, LoRABatch([LoRASegment(0, 4, 2)], 4)),
    }
    rejected = []
    for name, args in bad.items():
        try:
            lora_triton(*args)
        except ValueError:
            rejected.append(name)
    return rejected


def interpreter_report() -> dict[str, Any]:
    """Run every comparison; called in the child interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    return {
        "lora": {case.name: _lora_errors(case) for case in CASES},
        "rejected": _rejections(),
    }


@pytest.fixture(scope="module")
def sm90_child() -> Iterator[subprocess.Popen[str] | None]:
    """The sm_90 compile, started before the interpreter child so that the
    two overlap."""
    if not ptxas_available():
        yield None
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = start_child(__name__, "compile_for_sm90", env)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def report(sm90_child: subprocess.Popen[str] | None) -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return dict(child_result(start_child(__name__, "interpreter_report", env)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_lora_triton_matches_reference(report: dict[str, Any], case: LoRACase) -> None:
    result = report["lora"][case.name]
    assert result["err"] <= case.tol, f"{case.name}: relative error {result['err']}"
    assert result["base_changed"] == 0, f"{case.name}: changed rows outside every segment"


def test_lora_triton_rejects_bad_operands(report: dict[str, Any]) -> None:
    assert report["rejected"] == ["b-rank", "a-dtype", "num-tokens", "slot-range"]


# --- compiling for a GPU that is not there ------------------------------------

_SM90_VARIANTS = (
    # (dtype, num_tokens, rank): the smallest tiles, the largest (wgmma) ones,
    # and exact fp32 products.
    ("bf16", 1, 16),
    ("bf16", 4096, 96),
    ("fp32", 512, 48),
)


def compile_for_sm90() -> list[str]:
    """Compile both kernels for sm_90; returns one line per kernel built.
    Called in a child interpreter without TRITON_INTERPRET."""
    from kernels import triton_lora as tl_lora

    # The launcher passes contiguous columns, stride 1, which Triton
    # specialises to a constant; the other strides and the model's dimensions
    # are 16-divisible, which is what lets the loads vectorise and pipeline.
    divisible_dims = {"in_features", "out_features", "rank"}
    unit_strides = {"stride_x_k", "stride_a_k", "stride_b_r", "stride_y_n"}

    def build(
        kernel: Any, ptr_types: dict[str, str], constexprs: dict[str, Any], num_warps: int
    ) -> None:
        constexprs = {**constexprs, **{s: 1 for s in unit_strides if s in kernel.arg_names}}
        compile_sm90(
            kernel,
            ptr_types,
            constexprs,
            divisible=lambda arg: arg in divisible_dims or arg.startswith("stride_"),
            num_warps=num_warps,
        )

    lines = []
    for dtype, num_tokens, rank in _SM90_VARIANTS:
        cfg = tl_lora._config(num_tokens, rank, dtype == "fp32")
        common = {
            "BLOCK_M": cfg.block_m,
            "BLOCK_R": cfg.block_r,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "UPCAST_DOT": False,
        }
        ptr_types = {"*": f"*{dtype}", "token_slots_ptr": "*i32", "partial_ptr": "*fp32"}
        shrink = {**common, "BLOCK_K": cfg.block_k}
        build(tl_lora._lora_shrink_kernel, ptr_types, shrink, cfg.num_warps)
        lines.append(f"shrink {dtype} t{num_tokens} r{rank}")
        expand = {**common, "BLOCK_N": cfg.block_n}
        build(tl_lora._lora_expand_kernel, ptr_types, expand, cfg.num_warps)
        lines.append(f"expand {dtype} t{num_tokens} r{rank}")
    return lines


@pytest.mark.skipif(not ptxas_available(), reason="triton wheel without the bundled ptxas")
def test_lora_kernels_compile_for_h100(sm90_child: subprocess.Popen[str] | None) -> None:
    assert sm90_child is not None
    compiled = child_result(sm90_child)
    assert len(compiled) == 2 * len(_SM90_VARIANTS)
