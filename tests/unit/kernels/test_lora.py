"""The torch (CPU) batched LoRA path against a per-row loop."""

from __future__ import annotations

import torch

from kernels.lora import LoRABatch, LoRASegment, apply_lora


def test_segments_add_each_rows_adapter_and_leave_base_rows():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 6, 10, generator=gen)
    b = torch.randn(3, 7, 6, generator=gen)
    x = torch.randn(9, 10, generator=gen)
    y = torch.randn(9, 7, generator=gen)
    batch = LoRABatch([LoRASegment(1, 4, 2), LoRASegment(6, 8, 0)], 9)
    expected = y.clone()
    for row, slot in enumerate(batch.token_slots(torch.device("cpu")).tolist()):
        if slot >= 0:
            expected[row] += b[slot] @ (a[slot] @ x[row])
    apply_lora(y, x, a, b, batch)
    torch.testing.assert_close(y, expected)
    assert batch.token_slots(torch.device("cpu")).tolist() == [-1, 2, 2, 2, -1, -1, 0, 0, -1]


def _naive(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch
) -> torch.Tensor:
    out = y.clone()
    for row, slot in enumerate(batch.token_slots(torch.device("cpu")).tolist()):
        if slot >= 0:
            out[row] += b[slot] @ (a[slot] @ x[row])
    return out


def test_batched_layout_equals_the_segment_loop():
    """In order, with padding, with a slot gap, and the fallbacks."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(5, 4, 10, generator=gen)
    b = torch.randn(5, 7, 4, generator=gen)
    cases = [
        ([LoRASegment(0, 3, 0), LoRASegment(3, 6, 1), LoRASegment(6, 9, 2)], True),
        ([LoRASegment(2, 5, 3), LoRASegment(5, 7, 1), LoRASegment(8, 9, 4)], False),
        ([LoRASegment(0, 9, 1)], None),  # one adapter: the loop
        ([LoRASegment(0, 8, 0), LoRASegment(8, 9, 4)], None),  # padding would dominate
    ]
    for segments, in_order in cases:
        batch = LoRABatch(segments, 9)
        padded = batch.padded()
        assert (padded is None) == (in_order is None)
        if padded is not None:
            assert padded.in_order == in_order
        x = torch.randn(9, 10, generator=gen)
        y = torch.randn(9, 7, generator=gen)
        expected = _naive(y, x, a, b, batch)
        apply_lora(y, x, a, b, batch)
        torch.testing.assert_close(y, expected)
