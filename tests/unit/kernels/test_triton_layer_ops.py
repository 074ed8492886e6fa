"""The Triton layer ops against `TORCH_OPS`, run in Triton's CPU interpreter.

As in test_triton_kernels.py, the comparisons run in a child interpreter
with TRITON_INTERPRET=1 (`interpreter_report`) that prints one JSON report,
and a second child compiles every kernel for sm_90 (H100) without a GPU.

Errors are counted in ulps of the result's dtype at the reference value.
bfloat16 / float16 results may be 2 ulps off: the kernels round where torch
rounds, but a float32 intermediate that differs in its last bit (another
summation order in RMSNorm's mean, another exp in SiLU, a fused
multiply-add in RoPE on a GPU) can land a value on the other side of a
rounding boundary. float32 results may be 64 ulps off (~8e-6 relative),
the float32 reduction-order error of a 16k-wide row; an fp8 cache 1 ulp.
RoPE's ulps are taken at the larger input magnitude of each rotated pair
when that exceeds the result's (`_rope_floor`: cancellation). The residual
after `add_rms_norm` and the cache slots `rope_and_cache` must not write
are compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import pytest
import torch

from tests.unit.kernels.triton_child import (
    child_result,
    compile_sm90,
    ptxas_available,
    start_child,
)

# Seconds each (the Triton interpreter, child processes): left out of
# `make check`, run by `make test`.
pytestmark = pytest.mark.slow

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Most ulps of the result's dtype any output may be off by (see above).
MAX_ULPS = {"fp32": 64.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
TOKENS = (1, 3, 17)
# 10000 > the kernel's largest single block: the chunked two-pass path.
HIDDEN = (64, 576, 2048, 10000)
MAX_POS = 4096
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class RopeCase:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    dtype: str = "bf16"
    # The cache's dtype for rope_and_cache; None: the heads' own.
    cache_dtype: str | None = None


ROPE_CASES = (
    RopeCase("gqa-d64-fp32", 8, 2, 64, 64, "fp32"),
    RopeCase("gqa-d128-bf16", 8, 2, 128, 128, "bf16"),
    RopeCase("gqa-d128-fp16", 8, 2, 128, 128, "fp16"),
    RopeCase("partial-d128-r32-fp16", 8, 2, 128, 32, "fp16"),
    # Half the rotary dims (24) and the head count (6 + 2) not powers of two.
    RopeCase("partial-d64-r48-bf16", 6, 2, 64, 48, "bf16"),
    RopeCase("mha-d64-bf16", 4, 4, 64, 64, "bf16"),
)

CACHE_CASES = (
    *ROPE_CASES,
    RopeCase("no-rotary-bf16", 4, 2, 64, 0, "bf16"),
    RopeCase("fp32-over-bf16-cache", 8, 2, 64, 64, "fp32", "bf16"),
    RopeCase("partial-fp32-over-fp16-cache", 8, 2, 128, 32, "fp32", "fp16"),
    RopeCase("bf16-over-fp8-cache", 8, 2, 128, 128, "bf16", "fp8"),
)


def _ulps(
    got: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype | None = None,
    floor: torch.Tensor | None = None,
) -> float:
    """Max |got - want| in ulps of `dtype` (by default theirs) at the larger
    magnitude of the two, or of `floor` where that is larger."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    info = torch.finfo(dtype or got.dtype)
    a, b = got.double(), want.double()
    if bool((a.isnan() != b.isnan()).any()):
        return math.inf
    a, b = a.nan_to_num(), b.nan_to_num()
    magnitude = torch.maximum(a.abs(), b.abs())
    if floor is not None:
        magnitude = torch.maximum(magnitude, floor.double())
    _, exponent = torch.frexp(magnitude)
    ulp = torch.ldexp(torch.full_like(a, info.eps / 2), exponent).clamp_min(info.tiny * info.eps)
    return float(((a - b).abs() / ulp).max().item()) if a.numel() else 0.0


def _bit_mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((got.contiguous().view(torch.uint8) != want.contiguous().view(torch.uint8)).sum())


def _randn(
    *shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


# --- the comparisons (child interpreter) ------------------------------------------


def _norm_errors(name: str, tokens: int, hidden: int) -> dict[str, float]:
    from kernels import triton_layer_ops as tlo
    from kernels.layer_ops import TORCH_OPS

    dtype = DTYPES[name]
    gen = torch.Generator().manual_seed(tokens * 7 + hidden)
    # x as the first H columns of a wider buffer: a row stride > H.
    x = _randn(tokens, hidden + 8, dtype=dtype, gen=gen, scale=3.0)[:, :hidden]
    weight = _randn(hidden, dtype=dtype, gen=gen, scale=0.2) + 1
    delta = _randn(tokens, hidden, dtype=dtype, gen=gen)
    norm = _ulps(tlo.rms_norm(x, weight, EPS), TORCH_OPS.rms_norm(x, weight, EPS))
    residual, want_residual = x.clone(), x.clone()
    got = tlo.add_rms_norm(residual, delta, weight, EPS)
    want = TORCH_OPS.add_rms_norm(want_residual, delta, weight, EPS)
    return {
        "rms_norm": norm,
        "add_rms_norm": _ulps(got, want),
        "residual_bits": _bit_mismatches(residual, want_residual),
    }


def _silu_error(name: str, tokens: int, inter: int) -> float:
    from kernels import triton_layer_ops as tlo
    from kernels.layer_ops import TORCH_OPS

    gen = torch.Generator().manual_seed(tokens * 5 + inter)
    gate_up = _randn(tokens, 2 * inter, dtype=DTYPES[name], gen=gen, scale=4.0)
    got = tlo.silu_mul(gate_up)
    assert got.shape == (tokens, inter)
    return _ulps(got, TORCH_OPS.silu_mul(gate_up.clone()))


def _rope_inputs(
    case: RopeCase, tokens: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV output `[T, h + 2hkv, head_dim]` as a view of a wider
    buffer (token stride > its heads), positions up to ~MAX_POS, and
    transformers-style float32 cos/sin caches."""
    gen = torch.Generator().manual_seed(tokens * 3 + case.head_dim + case.rotary_dim)
    total = case.num_heads + 2 * case.num_kv_heads
    heads = _randn(tokens, total + 3, case.head_dim, dtype=dtype, gen=gen, scale=2.0)[:, :total]
    positions = torch.randint(0, MAX_POS - 96, (tokens,), generator=gen)
    positions[-1] = MAX_POS - 96  # the largest, ~4000
    rotary = max(case.rotary_dim, 2)
    inv_freq = 10000.0 ** (-torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return heads, positions, angles.cos().float(), angles.sin().float()


def _rope_floor(heads: torch.Tensor, rotated: int, rotary_dim: int) -> torch.Tensor:
    """Per element of the fused output, the larger input magnitude of its
    rotated pair (0 outside the rotation). RoPE's outputs are differences of
    products of about that size, so under cancellation a last-bit
    difference in a float32 intermediate (a fused multiply-add in torch's
    addcmul or on the GPU, not in the interpreter) is an ulp at that
    magnitude, not at the (small) result's."""
    floor = torch.zeros(heads.shape)
    half = rotary_dim // 2
    x = heads[:, :rotated, :rotary_dim].float().abs()
    pair = torch.maximum(x[..., :half], x[..., half:])
    floor[:, :rotated, :rotary_dim] = torch.cat((pair, pair), -1)
    return floor


def _rope_error(case: RopeCase, tokens: int) -> float:
    from kernels import triton_layer_ops as tlo
    from kernels.layer_ops import TORCH_OPS

    heads, positions, cos, sin = _rope_inputs(case, tokens, DTYPES[case.dtype])
    want = heads.clone()
    rotated = case.num_heads + case.num_kv_heads
    floor = _rope_floor(heads, rotated, case.rotary_dim)
    TORCH_OPS.rope_(
        want[:, :rotated, : case.rotary_dim], TORCH_OPS.rope_tables(cos, sin, positions)
    )
    tlo.rope_(heads[:, :rotated, : case.rotary_dim], tlo.rope_tables(cos, sin, positions))
    # The whole fused output: V heads and unrotated dims must not change.
    return _ulps(heads, want, floor=floor)


def _rope_and_cache_errors(case: RopeCase, tokens: int) -> dict[str, float]:
    from kernels import reference
    from kernels import triton_layer_ops as tlo
    from kernels.layer_ops import TORCH_OPS

    dtype = DTYPES[case.dtype]
    cache_dtype = (
        torch.float8_e4m3fn if case.cache_dtype == "fp8" else DTYPES[case.cache_dtype or case.dtype]
    )
    heads, positions, cos, sin = _rope_inputs(case, tokens, dtype)
    h, hkv, block_size = case.num_heads, case.num_kv_heads, 16
    gen = torch.Generator().manual_seed(tokens)
    # Slots scattered over 4 blocks; every third token a padding token (-1).
    slots = torch.randperm(4 * block_size, generator=gen)[:tokens]
    slots[1::3] = -1
    # Poisoned: a slot written by mistake, or a write skipped, shows.
    cache = torch.full((2, 4, block_size, hkv, case.head_dim), float("nan")).to(cache_dtype)

    want_heads, want_cache = heads.clone(), cache.clone()
    floor = _rope_floor(heads, h + hkv, case.rotary_dim)
    # The floor of each cached value, in the cache's layout.
    floor_cache = torch.zeros(cache.shape)
    if case.rotary_dim:
        TORCH_OPS.rope_(
            want_heads[:, : h + hkv, : case.rotary_dim],
            TORCH_OPS.rope_tables(cos, sin, positions),
        )
    kept = slots >= 0
    k, v = want_heads[:, h : h + hkv], want_heads[:, h + hkv :]
    reference.reshape_and_cache(k[kept], v[kept], want_cache, slots[kept])
    floor_k, floor_v = floor[:, h : h + hkv], floor[:, h + hkv :]
    reference.reshape_and_cache(floor_k[kept], floor_v[kept], floor_cache, slots[kept])

    tables = tlo.rope_tables(cos, sin, positions)
    tlo.rope_and_cache(heads, h, hkv, case.rotary_dim, tables, cache, slots)
    written = torch.zeros(4 * block_size, dtype=torch.bool)
    written[slots[kept]] = True
    written = written.view(4, block_size)
    return {
        "heads": _ulps(heads, want_heads, floor=floor),
        "cache": _ulps(
            cache.float()[:, written],
            want_cache.float()[:, written],
            cache_dtype,
            floor_cache[:, written],
        ),
        "untouched_bits": _bit_mismatches(
            cache.view(torch.uint8)[:, ~written], want_cache.view(torch.uint8)[:, ~written]
        ),
    }


def _int8_cache_refused() -> bool:
    from kernels import triton_layer_ops as tlo

    heads = torch.zeros(1, 3, 64)
    tables = tlo.rope_tables(
        torch.zeros(8, 32), torch.zeros(8, 32), torch.zeros(1, dtype=torch.long)
    )
    cache = torch.zeros(2, 1, 16, 1, 68, dtype=torch.int8)
    try:
        tlo.rope_and_cache(heads, 1, 1, 64, tables, cache, torch.zeros(1, dtype=torch.long))
    except ValueError as exc:
        return "int8" in str(exc)
    return False


def interpreter_report() -> dict[str, Any]:
    """Run every comparison; called in the child interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    return {
        "norm": {
            f"{name}-t{t}-h{hidden}": _norm_errors(name, t, hidden)
            for name in DTYPES
            for t in TOKENS
            for hidden in HIDDEN
        },
        "silu": {
            f"{name}-t{t}-i{inter}": _silu_error(name, t, inter)
            for name in DTYPES
            for t in TOKENS
            for inter in (64, 576, 2048)
        },
        "rope": {f"{c.name}-t{t}": _rope_error(c, t) for c in ROPE_CASES for t in TOKENS},
        "rope_and_cache": {
            f"{c.name}-t{t}": _rope_and_cache_errors(c, t) for c in CACHE_CASES for t in TOKENS
        },
        "int8_refused": _int8_cache_refused(),
    }


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return dict(child_result(start_child(__name__, "interpreter_report", env)))


def _tol(key: str) -> float:
    return MAX_ULPS[key.split("-")[0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norms_match_torch(report: dict[str, Any], dtype: str) -> None:
    for key, errors in report["norm"].items():
        if key.startswith(dtype):
            assert errors["rms_norm"] <= _tol(key), (key, errors)
            assert errors["add_rms_norm"] <= _tol(key), (key, errors)
            # The residual is rounded exactly as torch's add_ rounds it.
            assert errors["residual_bits"] == 0, (key, errors)


def test_silu_mul_matches_torch(report: dict[str, Any]) -> None:
    for key, ulps in report["silu"].items():
        assert ulps <= _tol(key), (key, ulps)


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: c.name)
def test_rope_matches_torch(report: dict[str, Any], case: RopeCase) -> None:
    for t in TOKENS:
        ulps = report["rope"][f"{case.name}-t{t}"]
        assert ulps <= MAX_ULPS[case.dtype], (t, ulps)


@pytest.mark.parametrize("case", CACHE_CASES, ids=lambda c: c.name)
def test_rope_and_cache_matches_rope_then_reshape(report: dict[str, Any], case: RopeCase) -> None:
    for t in TOKENS:
        errors = report["rope_and_cache"][f"{case.name}-t{t}"]
        assert errors["heads"] <= MAX_ULPS[case.dtype], (t, errors)
        assert errors["cache"] <= MAX_ULPS[case.cache_dtype or case.dtype], (t, errors)
        # Slots of padding tokens, and slots no token has, stay poisoned.
        assert errors["untouched_bits"] == 0, (t, errors)


def test_rope_and_cache_refuses_int8_cache(report: dict[str, Any]) -> None:
    assert report["int8_refused"]


# --- compiling for a GPU that is not there ------------------------------------


def compile_for_sm90() -> list[str]:
    """Compile every kernel variant for sm_90; returns one line per variant.
    Called in a child interpreter without TRITON_INTERPRET."""
    import triton

    from kernels import triton_layer_ops as tlo

    def build(
        kernel: Any, ptr_types: dict[str, str], constexprs: dict[str, Any], num_warps: int
    ) -> None:
        # The launchers' warp counts decide the registers each thread needs.
        compile_sm90(kernel, ptr_types, constexprs, floats=("eps",), num_warps=num_warps)

    lines = []
    for dtype, block, chunks, add in (
        ("bf16", 4096, 1, True),
        ("fp16", 1024, 1, False),
        ("fp32", 8192, 2, True),
        ("bf16", 8192, 2, False),
    ):
        constexprs = {"BLOCK_H": block, "CHUNKS": chunks, "ADD": add, "INTERPRETED": False}
        build(tlo._rms_norm_kernel, {"*": f"*{dtype}"}, constexprs, tlo._num_warps(block, 16))
        lines.append(f"rms_norm {dtype} block={block} chunks={chunks} add={add}")
    for dtype in ("bf16", "fp32"):
        constexprs = {"BLOCK": 1024, "INTERPRETED": False}
        build(tlo._silu_mul_kernel, {"*": f"*{dtype}"}, constexprs, tlo._num_warps(1024, 4))
        lines.append(f"silu_mul {dtype}")
    angles = {"positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    for dtype, half, half_pad, block_heads in (("bf16", 64, 64, 16), ("fp32", 24, 32, 8)):
        constexprs = {
            "HALF": half,
            "HALF_PAD": half_pad,
            "BLOCK_HEADS": block_heads,
            "INTERPRETED": False,
        }
        warps = tlo._num_warps(block_heads * half_pad, 4)
        build(tlo._rope_kernel, {"*": f"*{dtype}", **angles}, constexprs, warps)
        lines.append(f"rope {dtype} half={half}")
    for dtype, cache, head_dim, rotary_dim in (
        ("bf16", "bf16", 128, 128),
        ("fp32", "bf16", 128, 32),
        ("bf16", "fp8e4nv", 128, 128),
        ("fp16", "fp16", 64, 0),
    ):
        half = rotary_dim // 2
        half_pad = triton.next_power_of_2(max(half, 1))
        block_heads = tlo._head_block(32, half_pad)
        constexprs = {
            "NUM_HEADS": 32,
            "NUM_KV_HEADS": 8,
            "KV_PAD": 8,
            "HEAD_DIM": head_dim,
            "HEAD_PAD": head_dim,
            "TAIL_PAD": triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
            "HALF": half,
            "HALF_PAD": half_pad,
            "BLOCK_HEADS": block_heads,
            "Q_PROGRAMS": 32 // block_heads if half else 0,
            "BLOCK_SIZE": 16,
            "FP8": cache == "fp8e4nv",
            "INTERPRETED": False,
        }
        ptr_types = {
            "*": f"*{dtype}",
            **angles,
            "slot_mapping_ptr": "*i64",
            "k_cache_ptr": f"*{cache}",
            "v_cache_ptr": f"*{cache}",
        }
        warps = tlo._num_warps(block_heads * half_pad, 4)
        build(tlo._rope_and_cache_kernel, ptr_types, constexprs, warps)
        lines.append(f"rope_and_cache {dtype} over {cache} d{head_dim} r{rotary_dim}")
    return lines


@pytest.mark.skipif(not ptxas_available(), reason="triton wheel without the bundled ptxas")
def test_kernels_compile_for_h100() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    compiled = child_result(start_child(__name__, "compile_for_sm90", env))
    assert len(compiled) == 12, compiled
