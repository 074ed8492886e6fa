"""Masking the constrained rows of a step's logits (the runner's side)."""

from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr

from engine.structured_output.manager import GrammarBitmask


def apply_grammar_bitmask(
    logits: torch.Tensor, grammar: GrammarBitmask, first_row: dict[str, int]
) -> None:
    """Set to -inf, in place, every token the grammar forbids in the rows
    of ``logits`` its requests sample from (``first_row``: request id ->
    its first row; a request with several mask rows owns as many logits
    rows from there). Other rows are untouched. xgrammar's kernel: a
    compiled loop on CPU, its CUDA / Triton kernel on a GPU."""
    rows: list[int] = []
    found: list[int] = []
    for rid, (start, count) in zip(grammar.req_ids, grammar.row_spans(), strict=True):
        first = first_row.get(rid)
        if first is not None:
            rows.extend(range(first, first + count))
            found.extend(range(start, start + count))
    if not rows:
        return
    aligned = np.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=np.int32)
    aligned[rows] = grammar.bitmask[found]
    mask = torch.from_numpy(aligned).to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)
