"""Masking the constrained rows of a step's logits (the runner's side)."""

from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr

from engine.structured_output.manager import GrammarBitmask


def apply_grammar_bitmask(
    logits: torch.Tensor, grammar: GrammarBitmask, row_of: dict[str, int]
) -> None:
    """Set to -inf, in place, every token the grammar forbids in the rows
    of ``logits`` its requests sample from (``row_of``: request id -> row).
    Other rows are untouched. xgrammar's kernel: a compiled loop on CPU, its
    CUDA / Triton kernel on a GPU."""
    rows = [row_of[rid] for rid in grammar.req_ids if rid in row_of]
    if not rows:
        return
    aligned = np.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=np.int32)
    found = [i for i, rid in enumerate(grammar.req_ids) if rid in row_of]
    aligned[rows] = grammar.bitmask[found]
    mask = torch.from_numpy(aligned).to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)
