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

from kernels.metadata import AttentionMetadata
from tests.unit.kernels.batches import SHAPES, Shape, make_batch, new_kv_rows
from tests.unit.kernels.triton_child import (
    child_result,
    compile_sm90,
    ptxas_available,
    start_child,
)

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
    sliding_window: int | None = None
    # CUDA-graph-style metadata: `max_seq_len` as the model's limit, far
    # beyond every real sequence (block tables widened to it with the null
    # block), and `graph_padding` padding decodes (seq_len 1, every block the
    # null block, slot 0) after the real sequences. None / 0: the batch's own.
    graph_max_seq_len: int | None = None
    graph_padding: int = 0
    # The cache in fp8 (e4m3), the query in `dtype`: compared with the
    # reference over the fp8 values widened to float32.
    fp8_cache: bool = False


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
    # Few long decodes, what splits are for: each sequence's own range is
    # divided evenly, every split has work, the last a ragged tail.
    *(
        AttentionCase(
            f"long-b{len(lens)}-split{splits}",
            Shape((1,) * len(lens), lens, 8, 2, 64, 16),
            splits=splits,
        )
        for lens in ((3001,), (1999, 3900))
        for splits in (8, 16)
    ),
    # A replayed CUDA graph: max_seq_len is the model's limit, every real
    # sequence far shorter. Each is split over its own range; the shortest
    # leave later splits empty (max -inf, sum 0: merged with weight 0).
    AttentionCase(
        "graph-meta-split8",
        Shape((1, 1, 1, 1), (30, 97, 181, 300), 8, 2, 64, 16),
        splits=8,
        graph_max_seq_len=4096,
    ),
    # Under a window (contexts shorter and longer than it, and a prefill
    # chunk of several tiles): each tile splits its own in-window range.
    AttentionCase(
        "graph-meta-window-split8",
        Shape((1, 20, 1, 1), (30, 97, 181, 300), 8, 2, 64, 16),
        splits=8,
        sliding_window=64,
        graph_max_seq_len=4096,
    ),
    # A padded decode batch: padding rows read the null block only, and the
    # real rows are unaffected (split and unsplit).
    AttentionCase(
        "graph-padding-split8",
        Shape((1, 1, 1), (45, 130, 260), 8, 2, 64, 16),
        splits=8,
        graph_max_seq_len=4096,
        graph_padding=5,
    ),
    AttentionCase("graph-padding", Shape((1, 1), (45, 260), 6, 2, 128, 32), graph_padding=3),
    # An fp8 cache read in place (widened to bfloat16 in registers): the
    # error of bfloat16 products (the query and the probabilities rounded,
    # 2^-8 relative each) over the exact fp8 values, whose magnitude here is
    # up to ~16: 16 * 2^-7.
    AttentionCase("fp8-mixed", SHAPES[3], dtype=torch.bfloat16, tol=0.125, fp8_cache=True),
    AttentionCase(
        "fp8-decode-split4",
        Shape((1, 1), (700, 1500), 8, 2, 64, 16),
        dtype=torch.bfloat16,
        tol=0.125,
        splits=4,
        fp8_cache=True,
    ),
)

RESHAPE_CASES = ("fp32", "strided-key", "bf16", "negative-slot", "fp8")
FP8 = torch.float8_e4m3fn


def _as_graph_batch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    max_seq_len: int,
    padding: int,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The batch as a replayed decode CUDA graph sees it: a null block 0 (as
    the block pool's, holding a padding token's garbage) that no sequence
    owns, block tables as wide as `max_seq_len` with the null block past each
    sequence, `max_seq_len` for metadata, and `padding` padding sequences of
    one new token at slot 0 whose block-table rows are all the null block."""
    gen = torch.Generator().manual_seed(11)
    _, _, block_size, kv_heads, dim = kv_cache.shape
    null = 100 * torch.randn(2, 1, block_size, kv_heads, dim, generator=gen)
    kv_cache = torch.cat([null.to(kv_cache.dtype), kv_cache], dim=1)
    num_seqs, width = meta.block_table.shape
    block_table = torch.zeros(
        num_seqs + padding, max(width, -(-max_seq_len // block_size)), dtype=torch.int32
    )
    owned = torch.where(meta.block_table >= 0, meta.block_table + 1, 0)
    block_table[:num_seqs, :width] = owned
    pad_query = torch.randn(padding, *query.shape[1:], generator=gen).to(query.dtype)
    starts = meta.query_start_loc
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [meta.slot_mapping + block_size, torch.zeros(padding, dtype=torch.int64)]
        ),
        query_start_loc=torch.cat([starts, starts[-1] + torch.arange(1, padding + 1)]).to(
            torch.int32
        ),
        seq_lens=torch.cat([meta.seq_lens, torch.ones(padding, dtype=torch.int32)]),
        block_table=block_table,
        max_query_len=meta.max_query_len,
        max_seq_len=max_seq_len,
        decode_only=meta.decode_only,
    )
    return torch.cat([query, pad_query]), kv_cache, meta


def _attention_error(case: AttentionCase) -> float:
    from kernels import reference, triton_attention

    pad, fill = (2**30, float("nan")) if case.poisoned else (-1, 0.0)
    batch = make_batch(case.shape, dtype=case.dtype, seed=5, block_table_pad=pad, unused_fill=fill)
    scale = case.shape.head_dim**-0.5
    query, cache, meta = batch.query, batch.kv_cache, batch.meta
    if case.query_dtype is not None:
        query, cache = query.to(case.query_dtype), cache.to(case.query_dtype)
    kv_cache = batch.kv_cache
    if case.fp8_cache:
        kv_cache = (4 * kv_cache.float()).to(FP8)  # values up to ~16: fp8's normal range
        cache = kv_cache.float()
        want = reference.paged_attention(query.float(), cache, meta, scale, case.sliding_window)
    else:
        want = reference.paged_attention(query, cache, meta, scale, case.sliding_window)
    if case.strided_query:
        query = torch.cat([query, torch.zeros_like(query)], dim=1)[:, : query.shape[1]]
    if case.graph_max_seq_len is not None or case.graph_padding:
        max_seq_len = case.graph_max_seq_len or meta.max_seq_len
        query, kv_cache, meta = _as_graph_batch(
            query, kv_cache, meta, max_seq_len, case.graph_padding
        )
    got = triton_attention.paged_attention(
        query, kv_cache, meta, scale, case.sliding_window, num_kv_splits=case.splits
    )
    assert got.dtype == (case.query_dtype or case.dtype) and got.shape == query.shape
    # Padding rows' outputs are nobody's: only the real tokens are compared.
    return (got[: want.shape[0]].float() - want.float()).abs().max().item()


def _reshape_mismatches(name: str) -> int:
    from kernels import reference, triton_attention

    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    batch = make_batch(SHAPES[4], dtype=dtype)
    key, value = new_kv_rows(batch)
    slots = batch.meta.slot_mapping.clone()
    if name == "fp8":
        return _fp8_write_mismatches(batch.kv_cache, key, value, slots)
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


def _fp8_write_mismatches(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> int:
    """The fp8 write against the reference quantizer (clamp to +-448, then
    torch's round-to-nearest-even), bit for bit, over values that cross
    powers of two when rounded and some past the range."""
    from kernels import reference, triton_attention

    scaled = [x * 37.0 for x in (key, value)]
    for x in scaled:
        x.view(-1)[::7] *= 40.0  # past 448: clamped
        x.view(-1)[1::7] = 1.96  # rounds up to 2.0: the exponent carries
    got = cache.to(FP8)
    want = got.clone()
    key, value = scaled
    reference.reshape_and_cache(key.clamp(-448.0, 448.0), value.clamp(-448.0, 448.0), want, slots)
    triton_attention.reshape_and_cache(key, value, got, slots)
    return int((got.view(torch.uint8) != want.view(torch.uint8)).sum().item())


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
    # (dtype, group, head_dim, max_query_len, split, sliding window); fp8: the
    # cache's, over a bfloat16 query.
    ("bf16", 4, 128, 1, True, False),
    ("bf16", 4, 128, 512, False, False),
    ("fp16", 1, 256, 64, False, False),
    ("fp32", 3, 64, 1, False, False),
    ("bf16", 2, 128, 1, True, True),
    ("bf16", 2, 256, 512, False, True),
    ("fp8", 4, 128, 1, True, False),
    ("fp8", 4, 128, 512, False, False),
)


def compile_for_sm90() -> list[str]:
    """Compile every kernel for sm_90; returns one line per variant. Called in
    a child interpreter without TRITON_INTERPRET."""
    import triton

    from kernels import triton_attention as ta

    def build(kernel: Any, ptr_types: dict[str, str], constexprs: dict[str, Any]) -> Any:
        # Block-table strides are a row's length: not 16-divisible in general.
        return compile_sm90(
            kernel,
            ptr_types,
            constexprs,
            floats=("qk_scale",),
            divisible=lambda arg: arg.startswith("stride_") and "block_table" not in arg,
        )

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
            "FP8": dtype == "fp8",
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "UPCAST_DOT": False,
        }
        model_dtype = "bf16" if dtype == "fp8" else dtype
        stats = "fp32" if split else model_dtype
        cache = "fp8e4nv" if dtype == "fp8" else dtype
        ptr_types = {
            "*": f"*{model_dtype}",
            "k_cache_ptr": f"*{cache}",
            "v_cache_ptr": f"*{cache}",
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
    for fp8 in (False, True):
        cache = "*fp8e4nv" if fp8 else "*bf16"
        build(
            ta._reshape_and_cache_kernel,
            {"*": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "slot_mapping_ptr": "*i64"},
            {
                "NUM_KV_HEADS": 3,
                "HEADS_PAD": 4,
                "HEAD_DIM": 64,
                "BLOCK_SIZE": 16,
                "FP8": fp8,
                "INTERPRETED": False,
            },
        )
        lines.append(f"reshape_and_cache fp8={fp8}")
    return lines


@pytest.mark.skipif(not ptxas_available(), reason="triton wheel without the bundled ptxas")
def test_kernels_compile_for_h100() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    compiled = child_result(start_child(__name__, "compile_for_sm90", env))
    assert len(compiled) == len(_SM90_VARIANTS) + 3
