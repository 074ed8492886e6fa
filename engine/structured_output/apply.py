"""Masking the constrained rows of a step's logits (the runner's side).

In two halves: ``device_bitmask`` lays the step's grammar rows out against
the logits rows and copies them to the device before the forward is queued
(a copy from pageable memory would otherwise wait on a CUDA stream for the
forward to finish); ``apply_device_bitmask`` masks the logits once they exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from engine.structured_output.manager import GrammarBitmask


@dataclass(frozen=True)
class DeviceBitmask:
    """A step's grammar bitmask, one row per logits row, on the device;
    ``rows``: the logits rows it constrains."""

    mask: torch.Tensor  # int32 [logits rows, vocab words]
    rows: list[int]


def device_bitmask(
    grammar: GrammarBitmask, first_row: dict[str, int], num_rows: int, device: torch.device
) -> DeviceBitmask | None:
    """The mask rows of the requests in ``first_row`` (request id -> its first
    logits row; a request with several mask rows owns as many logits rows
    from there); None when none of them is constrained."""
    rows: list[int] = []
    found: list[int] = []
    for rid, (start, count) in zip(grammar.req_ids, grammar.row_spans(), strict=True):
        first = first_row.get(rid)
        if first is not None:
            rows.extend(range(first, first + count))
            found.extend(range(start, start + count))
    if not rows:
        return None
    aligned = np.full((num_rows, grammar.bitmask.shape[1]), -1, dtype=np.int32)
    aligned[rows] = grammar.bitmask[found]
    return DeviceBitmask(torch.from_numpy(aligned).to(device, non_blocking=True), rows)


def apply_device_bitmask(logits: torch.Tensor, mask: DeviceBitmask) -> None:
    """Set to -inf, in place, every token the grammar forbids in its rows;
    other rows are untouched. xgrammar's kernel: a compiled loop on CPU,
    its CUDA / Triton kernel on a GPU."""
    xgr.apply_token_bitmask_inplace(logits, mask.mask, indices=mask.rows)
