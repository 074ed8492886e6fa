"""Sliding-window attention in every backend against the reference, and the
reference against a dense banded mask built as transformers builds it
(`kv_idx > q_idx - sliding_window`, causal).

The windows are shorter than the contexts (else they hide nothing), 1, equal
to the block size and not multiples of it. A window at least as long as the
context must be no window at all, bit for bit. In the "unread" cases the
blocks wholly before a sequence's first in-window block are NaN: a backend
that reads them (even only to mask them) returns NaN, which is how these
tests check that windowed attention skips them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kernels import reference, torch_attention
from kernels.metadata import AttentionMetadata
from tests.unit.kernels.batches import PagedBatch, Shape, make_batch, over_bfloat16
from tests.unit.kernels.test_torch_attention import _compiled_bf16_products
from tests.unit.kernels.triton_child import child_result, start_child

WINDOW_SHAPES = (
    # Decodes of ragged lengths (one shorter than every window), GQA 3.
    Shape((1, 1, 1, 1), (1, 40, 77, 130), 6, 2, 64, 16),
    # Chunks over a cached prefix straddling the window's edge, a fresh
    # prompt longer than the windows, decodes.
    Shape((30, 1, 45, 1), (100, 60, 45, 20), 8, 2, 64, 16),
    # Block size 32, head dim 128, GQA 8.
    Shape((17, 1, 40), (64, 90, 40), 8, 1, 128, 32),
    # Head dim 256: the compiled decode kernel's portable path.
    Shape((1, 20, 1), (50, 37, 90), 4, 2, 256, 16),
    # Head dim 32: no compiled kernel; the torch gathers and SDPA.
    Shape((20, 1, 1), (50, 33, 9), 4, 2, 32, 16),
)
WINDOWS = (1, 5, 16, 23, 48)

TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _label(shape: Shape) -> str:
    return shape.label


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


# --- the reference ----------------------------------------------------------------


def dense_banded(batch: PagedBatch, scale: float, window: int) -> torch.Tensor:
    """Dense float64 attention over each sequence's contiguous K/V with
    transformers' sliding mask."""
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    starts = batch.meta.query_start_loc.tolist()
    for i, (k, v) in enumerate(batch.contexts):
        q = batch.query[starts[i] : starts[i + 1]].double().transpose(0, 1)
        group = q.shape[0] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q_idx = torch.arange(k.shape[1] - q.shape[1], k.shape[1])[:, None]
        kv_idx = torch.arange(k.shape[1])
        mask = (kv_idx <= q_idx) & (kv_idx > q_idx - window)
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[starts[i] : starts[i + 1]] = dense.transpose(0, 1)
    return out


@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=_label)
def test_reference_matches_dense_banded_attention(shape: Shape) -> None:
    batch = make_batch(shape, seed=3)
    scale = shape.head_dim**-0.5
    for window in WINDOWS:
        got = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, scale, window)
        want = dense_banded(batch, scale, window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=str(window))


def test_window_one_attends_to_the_token_itself() -> None:
    batch = make_batch(WINDOW_SHAPES[1], seed=3)
    got = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1, 1)
    group = batch.query.shape[1] // batch.kv_cache.shape[3]
    own_values = torch.cat([v[-len(q) :] for v, q in _values_and_queries(batch)])
    torch.testing.assert_close(got, own_values.repeat_interleave(group, dim=1))


def _values_and_queries(batch: PagedBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    starts = batch.meta.query_start_loc.tolist()
    return [(v, batch.query[starts[i] : starts[i + 1]]) for i, (_, v) in enumerate(batch.contexts)]


# --- the torch path (and the compiled kernels it calls) ---------------------------


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=_label)
def test_torch_path_matches_reference(shape: Shape, dtype: torch.dtype) -> None:
    batch = make_batch(shape, dtype=dtype, seed=11)
    scale = shape.head_dim**-0.5
    for window in WINDOWS:
        want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, scale, window)
        got = torch_attention.paged_attention(
            batch.query, batch.kv_cache, batch.meta, scale, window
        )
        assert got.dtype == dtype
        assert _error(got, want) <= TOLERANCES[dtype], (window, _error(got, want))


@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=_label)
def test_torch_path_float32_over_a_bfloat16_cache(shape: Shape) -> None:
    """The compiled kernels' bfloat16 cache (rows widened, or bfloat16
    products in the prefill kernel where the CPU has them)."""
    batch = make_batch(shape, dtype=torch.bfloat16, seed=11)
    query, scale = batch.query.float(), shape.head_dim**-0.5
    products = _compiled_bf16_products(shape)
    for window in WINDOWS:
        want, atol = over_bfloat16(products, query, batch.kv_cache, batch.meta, scale, window)
        got = torch_attention.paged_attention(query, batch.kv_cache, batch.meta, scale, window)
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=str(window))


def spare_padded(batch: PagedBatch) -> PagedBatch:
    """The batch with its block-table padding pointing at a block no sequence
    owns: the torch decode gather reads padding columns (masked) and requires
    them finite, so it must not land on a poisoned block."""
    bs = batch.kv_cache.shape[2]
    owned = {
        int(block)
        for i, seq_len in enumerate(batch.meta.seq_lens.tolist())
        for block in batch.meta.block_table[i, : -(-seq_len // bs)]
    }
    spare = min(set(range(batch.kv_cache.shape[1])) - owned)
    table = batch.meta.block_table.masked_fill(batch.meta.block_table < 0, spare)
    return dataclasses.replace(batch, meta=dataclasses.replace(batch.meta, block_table=table))


def poison_unread_blocks(batch: PagedBatch, window: int) -> None:
    """NaN into each sequence's blocks wholly before the first in-window
    block of its first new token: no backend may read them."""
    bs = batch.kv_cache.shape[2]
    starts = batch.meta.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.meta.seq_lens.tolist()):
        first_pos = seq_len - (starts[i + 1] - starts[i])
        first_block = max(0, first_pos - window + 1) // bs
        batch.kv_cache[:, batch.meta.block_table[i, :first_block].long()] = float("nan")


UNREAD_CASES = (
    (WINDOW_SHAPES[0], 5),
    (WINDOW_SHAPES[0], 23),
    (WINDOW_SHAPES[1], 16),
    (WINDOW_SHAPES[2], 23),
    (WINDOW_SHAPES[3], 5),
    (WINDOW_SHAPES[4], 5),
    # One 300-token chunk over a 400-token prefix: the torch path's tiles.
    (Shape((300,), (700,), 2, 1, 64, 16), 40),
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("shape", "window"), UNREAD_CASES, ids=lambda c: str(c))
def test_torch_path_never_reads_blocks_before_the_window(
    shape: Shape, window: int, dtype: torch.dtype
) -> None:
    batch = spare_padded(make_batch(shape, dtype=dtype, seed=2))
    scale = shape.head_dim**-0.5
    want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, scale, window)
    poison_unread_blocks(batch, window)
    assert batch.kv_cache.isnan().any() or max(shape.seq_lens) <= window + shape.block_size
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, scale, window)
    assert _error(got, want) <= TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=_label)
def test_a_window_covering_the_context_is_no_window(shape: Shape, dtype: torch.dtype) -> None:
    batch = make_batch(shape, dtype=dtype, seed=4)
    query, meta = batch.query.float(), batch.meta
    for ops in (reference, torch_attention):
        plain = ops.paged_attention(query, batch.kv_cache, meta, 0.1)
        assert torch.equal(ops.paged_attention(query, batch.kv_cache, meta, 0.1, None), plain)
        for window in (meta.max_seq_len, 10**6):
            got = ops.paged_attention(query, batch.kv_cache, meta, 0.1, window)
            assert torch.equal(got, plain), (ops.__name__, window)


def test_alternating_windows_in_one_forward_pass() -> None:
    """Local and global layers interleaved (Gemma 3) over one metadata
    object: each layer gets its own window's plan."""
    batch = make_batch(WINDOW_SHAPES[1], seed=6)
    for window in (None, 5, None, 23, 5):
        want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1, window)
        got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1, window)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0, msg=str(window))


@pytest.mark.parametrize("window", [0, -3])
@pytest.mark.parametrize("ops", [reference, torch_attention], ids=lambda m: m.__name__)
def test_windows_below_one_are_rejected(ops: Any, window: int) -> None:
    batch = make_batch(WINDOW_SHAPES[0])
    with pytest.raises(ValueError, match=f"got {window}"):
        ops.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1, window)


# --- Triton, in the interpreter (a child process: see test_triton_kernels) --------


@dataclasses.dataclass(frozen=True)
class TritonCase:
    name: str
    shape: Shape
    window: int
    splits: int | None = None
    dtype: torch.dtype = torch.float32
    unread: bool = False  # poison the blocks before the window


TRITON_CASES = (
    TritonCase("decode-w1", WINDOW_SHAPES[0], 1),
    TritonCase("decode-w5", WINDOW_SHAPES[0], 5),
    TritonCase("decode-w16", WINDOW_SHAPES[0], 16),
    TritonCase("decode-w23-split3", WINDOW_SHAPES[0], 23, splits=3),
    TritonCase("mixed-w1", WINDOW_SHAPES[1], 1),
    TritonCase("mixed-w23", WINDOW_SHAPES[1], 23),
    TritonCase("mixed-w48-split2", WINDOW_SHAPES[1], 48, splits=2),
    TritonCase("gqa8-b32-w5", WINDOW_SHAPES[2], 5),
    TritonCase("mixed-w23-bf16", WINDOW_SHAPES[1], 23, dtype=torch.bfloat16),
    TritonCase("decode-w5-unread", WINDOW_SHAPES[0], 5, unread=True),
    TritonCase("mixed-w16-split2-unread", WINDOW_SHAPES[1], 16, splits=2, unread=True),
)


def _triton_error(case: TritonCase) -> float:
    from kernels import triton_attention

    batch = make_batch(case.shape, dtype=case.dtype, seed=5)
    scale = case.shape.head_dim**-0.5
    want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, scale, case.window)
    if case.unread:
        poison_unread_blocks(batch, case.window)
    got = triton_attention.paged_attention(
        batch.query, batch.kv_cache, batch.meta, scale, case.window, num_kv_splits=case.splits
    )
    return _error(got, want)


def _triton_covering_window_is_no_window() -> bool:
    from kernels import triton_attention

    batch = make_batch(WINDOW_SHAPES[1], seed=5)
    meta: AttentionMetadata = batch.meta
    plain = triton_attention.paged_attention(batch.query, batch.kv_cache, meta, 0.1)
    covering = triton_attention.paged_attention(
        batch.query, batch.kv_cache, meta, 0.1, meta.max_seq_len
    )
    return bool(torch.equal(plain, covering))


def _triton_rejects_window_zero() -> bool:
    from kernels import triton_attention

    batch = make_batch(WINDOW_SHAPES[0])
    try:
        triton_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1, 0)
    except ValueError as exc:
        return "got 0" in str(exc)
    return False


def triton_window_report() -> dict[str, Any]:
    """Every Triton comparison; called in the child interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    return {
        "errors": {case.name: _triton_error(case) for case in TRITON_CASES},
        "covering_is_plain": _triton_covering_window_is_no_window(),
        "rejects_zero": _triton_rejects_window_zero(),
    }


@pytest.fixture(scope="module")
def triton_report() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return dict(child_result(start_child(__name__, "triton_window_report", env)))


@pytest.mark.slow
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.name)
def test_triton_matches_reference(triton_report: dict[str, Any], case: TritonCase) -> None:
    err = triton_report["errors"][case.name]
    assert err <= TOLERANCES[case.dtype], f"{case.name}: max abs error {err}"


@pytest.mark.slow
def test_triton_window_covering_the_context_is_no_window(triton_report: dict[str, Any]) -> None:
    assert triton_report["covering_is_plain"]


@pytest.mark.slow
def test_triton_rejects_windows_below_one(triton_report: dict[str, Any]) -> None:
    assert triton_report["rejects_zero"]
