"""The vectorised torch path against the reference kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import cpu_kernels, reference, torch_attention
from kernels.metadata import AttentionMetadata
from tests.unit.kernels.batches import SHAPES, Shape, make_batch, new_kv_rows, over_bfloat16

TOLERANCES = {
    torch.float32: 2e-5,
    # Outputs are O(1); half precision rounds K/V/probabilities to ~3 digits.
    torch.bfloat16: 3e-2,
    torch.float16: 4e-3,
}


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_paged_attention_matches_reference(shape: Shape, dtype: torch.dtype) -> None:
    batch = make_batch(shape, dtype=dtype, seed=11)
    scale = shape.head_dim**-0.5
    want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, scale)
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, scale)
    assert got.dtype == dtype and got.shape == batch.query.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOLERANCES[dtype], err


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_float32_queries_over_a_narrower_cache(shape: Shape, cache_dtype: torch.dtype) -> None:
    """--kv-cache-dtype: attention computes in float32 over the cache's rows
    widened, decodes and prefill chunks alike (masks follow the compute
    dtype), except where the compiled prefill kernel multiplies a bfloat16
    cache's rows as bfloat16 pairs (AVX512_BF16; tests/unit/kernels/batches.py)."""
    batch = make_batch(shape, dtype=cache_dtype, seed=11)
    query = batch.query.float()
    scale = shape.head_dim**-0.5
    products = cache_dtype == torch.bfloat16 and _compiled_bf16_products(shape)
    want, atol = over_bfloat16(products, query, batch.kv_cache, batch.meta, scale)
    got = torch_attention.paged_attention(query, batch.kv_cache, batch.meta, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


def _compiled_bf16_products(shape: Shape) -> bool:
    """Whether the batch's prefill chunks reach the compiled prefill kernel
    and it takes bfloat16 products."""
    kernel = cpu_kernels.load()
    group = shape.num_heads // shape.num_kv_heads
    return (
        kernel is not None
        and max(shape.q_lens) > 1
        and kernel.prefill_attention_applies(shape.head_dim, group, shape.block_size)
        and kernel.prefill_attention_bf16_products()
    )


def test_all_decode_batch_not_flagged_decode_only() -> None:
    batch = make_batch(SHAPES[1])
    meta = dataclasses.replace(batch.meta, decode_only=False)
    want = reference.paged_attention(batch.query, batch.kv_cache, meta, 0.1)
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, meta, 0.1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def _one_row(meta: AttentionMetadata, seq: int, row: int, prompt: bool) -> AttentionMetadata:
    """Row `row` of sequence `seq` alone, as a prompt row or an output row."""
    starts = meta.query_start_loc.tolist()
    seq_len = int(meta.seq_lens[seq]) - (starts[seq + 1] - 1 - row)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[row : row + 1],
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_table=meta.block_table[seq : seq + 1],
        max_query_len=1,
        max_seq_len=seq_len,
        decode_only=not prompt,
        prompt_rows=(int(prompt),),
    )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_take_their_kind_of_arithmetic_whatever_the_batch(cache_dtype: torch.dtype) -> None:
    """prompt_rows: a chunk's prompt rows take the prefill kernels, its
    output rows the decode kernels, each row bit for bit as when it runs
    alone as that kind (a prompt token recomputed alone after a prefix hit;
    a P/D decode pod's first output token after the prompt's tail)."""
    shape = Shape((6, 1, 5), (40, 17, 21), 6, 2, 64, 16)
    batch = make_batch(shape, dtype=cache_dtype, seed=5)
    query = batch.query.float()
    meta = dataclasses.replace(batch.meta, prompt_rows=(4, 1, 5))
    got = torch_attention.paged_attention(query, batch.kv_cache, meta, 0.125)
    kinds = (
        [(0, r, r < 4) for r in range(6)] + [(1, 6, True)] + [(2, r, True) for r in range(7, 12)]
    )
    for seq, row, prompt in kinds:
        alone = _one_row(meta, seq, row, prompt)
        want = torch_attention.paged_attention(query[row : row + 1], batch.kv_cache, alone, 0.125)
        assert torch.equal(got[row : row + 1], want), (seq, row, prompt)
    # Each kind within the reference's tolerance of exact attention.
    exact = reference.paged_attention(query, batch.kv_cache.float(), batch.meta, 0.125)
    torch.testing.assert_close(got, exact, atol=TOLERANCES[cache_dtype], rtol=0)


@pytest.mark.parametrize("pad", [-1, 0, 10**6])
def test_block_table_padding_is_ignored(pad: int) -> None:
    # Entries past a sequence's last block may hold anything, even ids that
    # are not blocks at all.
    batch = make_batch(SHAPES[3], block_table_pad=pad)
    want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.125)
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_strided_query_from_fused_projection() -> None:
    # q/k/v usually come out of one fused projection: q is a strided view.
    batch = make_batch(SHAPES[3])
    fused = torch.cat([batch.query, torch.zeros_like(batch.query)], dim=1)
    query = fused[:, : batch.query.shape[1]]
    want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.125)
    got = torch_attention.paged_attention(query, batch.kv_cache, batch.meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reshape_and_cache_matches_reference(dtype: torch.dtype) -> None:
    batch = make_batch(SHAPES[3], dtype=dtype)
    key, value = new_kv_rows(batch, dtype=torch.float32)
    want = batch.kv_cache.clone()
    reference.reshape_and_cache(key, value, want, batch.meta.slot_mapping)
    torch_attention.reshape_and_cache(key, value, batch.kv_cache, batch.meta.slot_mapping)
    assert torch.equal(batch.kv_cache, want)


def test_reshape_then_attend_sees_the_new_tokens() -> None:
    # The engine's order within a layer: write this step's K/V, then attend.
    batch = make_batch(SHAPES[4])
    key, value = new_kv_rows(batch)
    want_cache = batch.kv_cache.clone()
    reference.reshape_and_cache(key, value, want_cache, batch.meta.slot_mapping)
    want = reference.paged_attention(batch.query, want_cache, batch.meta, 0.1)
    torch_attention.reshape_and_cache(key, value, batch.kv_cache, batch.meta.slot_mapping)
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_a_new_metadata_object_gets_a_new_plan() -> None:
    batch = make_batch(SHAPES[3])
    torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1)
    # The next step's metadata: a decode whose context shrank from 40 to 35.
    seq_lens = batch.meta.seq_lens.clone()
    seq_lens[0] -= 5
    meta = dataclasses.replace(batch.meta, seq_lens=seq_lens)
    want = reference.paged_attention(batch.query, batch.kv_cache, meta, 0.1)
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, meta, 0.1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_plan_follows_the_cache_geometry() -> None:
    # Same metadata, a cache with more blocks: gather rows must be recomputed.
    batch = make_batch(SHAPES[0])
    torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1)
    bigger = torch.cat([batch.kv_cache, torch.zeros_like(batch.kv_cache)], dim=1)
    want = reference.paged_attention(batch.query, bigger, batch.meta, 0.1)
    got = torch_attention.paged_attention(batch.query, bigger, batch.meta, 0.1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_empty_batch() -> None:
    batch = make_batch(SHAPES[0])
    meta = dataclasses.replace(
        batch.meta,
        slot_mapping=batch.meta.slot_mapping[:0],
        query_start_loc=batch.meta.query_start_loc[:1],
        seq_lens=batch.meta.seq_lens[:0],
        block_table=batch.meta.block_table[:0],
        max_query_len=0,
        max_seq_len=0,
    )
    out = torch_attention.paged_attention(batch.query[:0], batch.kv_cache, meta, 0.1)
    assert out.shape == (0, *batch.query.shape[1:])
