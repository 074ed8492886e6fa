"""The reference kernels against plain dense causal attention.

Each sequence's K/V also lives in a contiguous tensor; the paged copy is
scattered over shuffled blocks. Dense SDPA (float64, GQA by repeating KV
heads) on the contiguous copy must agree with the reference on the paged one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from tests.unit.kernels.batches import SHAPES, PagedBatch, Shape, make_batch, new_kv_rows


def dense_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    starts = batch.meta.query_start_loc.tolist()
    for i, (k, v) in enumerate(batch.contexts):
        q = batch.query[starts[i] : starts[i + 1]].double().transpose(0, 1)  # [H, q, D]
        group = q.shape[0] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q_len, seq_len = q.shape[1], k.shape[1]
        # Bottom-right aligned causal mask: the new tokens are the last q_len.
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[starts[i] : starts[i + 1]] = dense.transpose(0, 1)
    return out


CASES = {
    "prefill": Shape((12, 20), (12, 20), 4, 2, 64, 16),
    "chunked-prefill": Shape((7, 16), (40, 33), 6, 2, 64, 16),
    "decode": Shape((1, 1, 1), (1, 17, 48), 4, 4, 64, 16),
    "mixed-gqa8": Shape((1, 5, 9), (30, 5, 50), 8, 1, 32, 32),
}


@pytest.mark.parametrize("shape", list(CASES.values()) + list(SHAPES), ids=lambda s: s.label)
def test_reference_matches_dense_attention(shape: Shape) -> None:
    batch = make_batch(shape, seed=3)
    scale = shape.head_dim**-0.5
    got = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, scale)
    torch.testing.assert_close(got.double(), dense_attention(batch, scale), atol=1e-5, rtol=1e-5)


def test_reference_reshape_and_cache_writes_each_token_to_its_slot() -> None:
    batch = make_batch(CASES["chunked-prefill"])
    key, value = new_kv_rows(batch)
    reference.reshape_and_cache(key, value, batch.kv_cache, batch.meta.slot_mapping)
    slots = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    assert torch.equal(slots[0, batch.meta.slot_mapping], key)
    assert torch.equal(slots[1, batch.meta.slot_mapping], value)
