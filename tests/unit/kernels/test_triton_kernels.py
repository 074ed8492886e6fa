"""The Triton kernels against the reference, run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, and another
test may already have imported it in this process, so the comparisons run
in a child interpreter (`interpreter_report`) that prints one JSON report;
the tests here only read it. A second child compiles the kernels for sm_90
(H100) without a GPU, which catches what the interpreter is lenient about
(operand types of tl.dot, constexpr misuse, shared-memory overflow).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

from tests.unit.kernels.batches import SHAPES, Shape, make_batch, new_kv_rows
from tests.unit.kernels.triton_child import child_result, ptxas_available, start_child

# Seconds each (the real model, the Triton interpreter, child processes or
# Helm renders): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow

FP32_TOL = 2e-5


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    name: str
    shape: Shape
    dtype: torch.dtype = torch.float32
    splits: int | None = None  # forced KV splits; None = the launcher's choice
    tol: float = FP32_TOL
    # Poison what the kernel must never read: padded block-table entries and
    # cache slots past every sequence's end.
    poisoned: bool = False
    # Query as a head slice of a fused QKV projection (token stride > heads * dim).
    strided_query: bool = False
    # A float32 model over a cache of `dtype` (--kv-cache-dtype); None: the same.
    query_dtype: torch.dtype | None = None


ATTENTION_CASES = (
    *(AttentionCase(shape.label, shape) for shape in SHAPES),
    AttentionCase("decode-split3", Shape((1, 1, 1), (100, 7, 150), 6, 2, 64, 16), splits=4),
    AttentionCase("mixed-split2", SHAPES[3], splits=2),
    # Chunk rows whose causal limit falls before the second split's start see
    # nothing there: their partial max stays -inf and must merge as weight 0.
    AttentionCase("chunk-across-split", Shape((20, 1), (45, 60), 6, 2, 64, 16), splits=2),
    AttentionCase("poisoned-cache", SHAPES[3], poisoned=True),
    AttentionCase("poisoned-split", SHAPES[0], splits=2, poisoned=True),
    AttentionCase("strided-query", SHAPES[4], strided_query=True),
    AttentionCase("bf16", SHAPES[3], dtype=torch.bfloat16, tol=3e-2),
    AttentionCase("fp16", SHAPES[4], dtype=torch.float16, tol=4e-3),
    # The kernel computes in the cache's dtype: bf16 precision on GPU.
    AttentionCase(
        "fp32-query-bf16-cache",
        SHAPES[3],
        dtype=torch.bfloat16,
        tol=3e-2,
        query_dtype=torch.float32,
    ),
)

RESHAPE_CASES = ("fp32", "strided-key", "bf16", "negative-slot")


def _attention_error(case: AttentionCase) -> float:
    from kernels import reference, triton_attention

    pad, fill = (2**30, float("nan")) if case.poisoned else (-1, 0.0)
    batch = make_batch(case.shape, dtype=case.dtype, seed=5, block_table_pad=pad, unused_fill=fill)
    scale = case.shape.head_dim**-0.5
    query, cache = batch.query, batch.kv_cache
    if case.query_dtype is not None:
        query, cache = query.to(case.query_dtype), cache.to(case.query_dtype)
    want = reference.paged_attention(query, cache, batch.meta, scale)
    if case.strided_query:
        query = torch.cat([query, torch.zeros_like(query)], dim=1)[:, : query.shape[1]]
    got = triton_attention.paged_attention(
        query, batch.kv_cache, batch.meta, scale, num_kv_splits=case.splits
    )
    assert got.dtype == (case.query_dtype or case.dtype) and got.shape == want.shape
    return (got.float() - want.float()).abs().max().item()


def _reshape_mismatches(name: str) -> int:
    from kernels import reference, triton_attention

    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    batch = make_batch(SHAPES[4], dtype=dtype)
    key, value = new_kv_rows(batch)
    slots = batch.meta.slot_mapping.clone()
    if name == "strided-key":
        # K and V as head slices of one fused projection output.
        fused = torch.cat([key, value, key], dim=1)
        heads = key.shape[1]
        key, value = fused[:, :heads], fused[:, heads : 2 * heads]
    if name == "negative-slot":
        slots[::2] = -1  # padding tokens: written nowhere
    want = batch.kv_cache.clone()
    kept = slots >= 0
    reference.reshape_and_cache(key[kept], value[kept], want, slots[kept])
    triton_attention.reshape_and_cache(key, value, batch.kv_cache, slots)
    return int((batch.kv_cache != want).sum().item())


def interpreter_report() -> dict[str, Any]:
    """Run every comparison; called in the child interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    return {
        "attention": {case.name: _attention_error(case) for case in ATTENTION_CASES},
        "reshape": {name: _reshape_mismatches(name) for name in RESHAPE_CASES},
    }


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return dict(child_result(start_child(__name__, "interpreter_report", env)))


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.name)
def test_paged_attention_matches_reference(report: dict[str, Any], case: AttentionCase) -> None:
    err = report["attention"][case.name]
    assert err <= case.tol, f"{case.name}: max abs error {err}"


@pytest.mark.parametrize("name", RESHAPE_CASES)
def test_reshape_and_cache_matches_reference(report: dict[str, Any], name: str) -> None:
    assert report["reshape"][name] == 0


# --- compiling for a GPU that is not there ------------------------------------

_SM90_VARIANTS = (
    # (dtype, group, head_dim, max_query_len, split, sliding window)
    ("bf16", 4, 128, 1, True, False),
    ("bf16", 4, 128, 512, False, False),
    ("fp16", 1, 256, 64, False, False),
    ("fp32", 3, 64, 1, False, False),
    ("bf16", 2, 128, 1, True, True),
    ("bf16", 2, 256, 512, False, True),
)


def compile_for_sm90() -> list[str]:
    """Compile every kernel for sm_90; returns one line per variant. Called in
    a child interpreter without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_attention as ta

    target = GPUTarget("cuda", 90, 32)

    def build(kernel: Any, ptr_types: dict[str, str], constexprs: dict[str, Any]) -> Any:
        signature = {}
        for arg in kernel.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = ptr_types.get(arg, ptr_types["*"])
            else:
                signature[arg] = "fp32" if arg == "qk_scale" else "i32"
        # Mark pointers and strides 16-divisible as the launcher's
        # specialisation would, so vectorisation (and register use) match.
        aligned = [
            i
            for i, arg in enumerate(kernel.arg_names)
            if arg.endswith("_ptr") or (arg.startswith("stride_") and "block_table" not in arg)
        ]
        attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
        return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target)

    lines = []
    for dtype, group, head_dim, max_query_len, split, windowed in _SM90_VARIANTS:
        group_pad = triton.next_power_of_2(group)
        cfg = ta._tile_config(max_query_len, group_pad, head_dim, dtype == "fp32")
        constexprs = {
            "GROUP": group,
            "GROUP_PAD": group_pad,
            "BLOCK_Q": cfg.block_q,
            "BLOCK_N": cfg.block_n,
            "HEAD_DIM": head_dim,
            "BLOCK_SIZE": 16,
            "SPLIT": split,
            "WINDOWED": windowed,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "UPCAST_DOT": False,
        }
        stats = "fp32" if split else dtype
        ptr_types = {
            "*": f"*{dtype}",
            "out_ptr": f"*{stats}",
            "partial_max_ptr": f"*{stats}",
            "partial_sum_ptr": f"*{stats}",
            "query_start_loc_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "block_table_ptr": "*i32",
        }
        build(ta._paged_attention_kernel, ptr_types, constexprs)
        lines.append(
            f"attention {dtype} g{group} d{head_dim} q{max_query_len} split={split} "
            f"window={windowed}"
        )
    build(
        ta._merge_splits_kernel,
        {"*": "*fp32", "out_ptr": "*bf16"},
        {"SPLITS_PAD": 32, "HEAD_DIM": 128},
    )
    lines.append("merge")
    build(
        ta._reshape_and_cache_kernel,
        {"*": "*bf16", "slot_mapping_ptr": "*i64"},
        {"NUM_KV_HEADS": 3, "HEADS_PAD": 4, "HEAD_DIM": 64, "BLOCK_SIZE": 16},
    )
    lines.append("reshape_and_cache")
    return lines


@pytest.mark.skipif(not ptxas_available(), reason="triton wheel without the bundled ptxas")
def test_kernels_compile_for_h100() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    compiled = child_result(start_child(__name__, "compile_for_sm90", env))
    assert len(compiled) == len(_SM90_VARIANTS) + 2
