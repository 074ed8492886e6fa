"""The runner's side of draft verification: one sampling row per position.

A row with ``k`` drafts has ``k + 1`` logits rows. Each is adjusted as a
plain sample at that position would be: its logit bias, and penalties that
count the drafts before it as output (``TokenHistory.extra``). The grammar
mask was applied per position already. Then ``rejection.verify`` decides,
and logprobs (when asked) are those of the tokens the step yields.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from engine.outputs import LogprobsLists
from engine.spec_decode.rejection import DraftRows, verify
from engine.worker.input_batch import InputBatch
from engine.worker.penalties import TokenHistory
from engine.worker.sampler import (
    SamplingTensors,
    adjust_logits,
    compute_logprobs,
    is_greedy,
    target_probs,
)


@dataclass(frozen=True)
class VerifyResult:
    tokens: list[list[int]]  # per sampling row: accepted drafts, then one more
    num_accepted: list[int]
    logprobs: LogprobsLists | None  # one row per yielded token


def verify_drafts(
    logits: torch.Tensor,
    batch: InputBatch,
    sample_rows: npt.NDArray[np.int64],
    rows: DraftRows,
    device: torch.device,
) -> VerifyResult:
    """``logits`` [M, V]: raw target logits, ``1 + len(rows.drafts[i])``
    rows from ``rows.starts[i]`` for sampling row ``i`` (batch row
    ``sample_rows[i]``), masked by the grammar where one applies."""
    counts = np.array([len(d) + 1 for d in rows.drafts], np.int64)
    states = [batch.states[r] for r in sample_rows.tolist()]
    params = [s.sampling_params for s in states]
    expanded = [p for p, c in zip(params, counts.tolist(), strict=True) for _ in range(c)]
    # Position j of a row sees the row's tokens plus its first j drafts.
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    history = TokenHistory(
        batch.token_ids,
        batch.num_tokens,
        batch.output_start,
        np.repeat(sample_rows, counts),
        extra=within,
    )
    # Generators stay out of the tensors: verify draws from them itself.
    tensors = SamplingTensors.from_params(expanded, [None] * len(expanded), device, history)
    adjusted = adjust_logits(logits, tensors)
    probs = None if tensors.all_greedy else target_probs(adjusted, tensors)
    greedy = [is_greedy(p) for p in params]
    greedy_rows = None
    if any(greedy) and not all(greedy):
        greedy_rows = torch.tensor(greedy, dtype=torch.bool)
    generators = {
        i: s.generator
        for i, (s, g) in enumerate(zip(states, greedy, strict=True))
        if s.generator is not None and not g
    }
    result = verify(adjusted, rows, greedy_rows, probs, generators)
    logprobs = None
    if tensors.max_num_logprobs is not None:
        logprobs = _yielded_logprobs(
            logits,
            result.position_tokens,
            tensors.max_num_logprobs,
            rows,
            result.num_accepted,
            [p.logprobs or 0 for p in params],
            batch.num_reqs,
            sample_rows,
        )
    return VerifyResult(result.tokens, result.num_accepted, logprobs)


def _yielded_logprobs(
    logits: torch.Tensor,
    position_tokens: torch.Tensor,
    num_top: int,
    rows: DraftRows,
    num_accepted: list[int],
    per_row: list[int],
    num_reqs: int,
    sample_rows: npt.NDArray[np.int64],
) -> LogprobsLists:
    """Logprobs of the raw logits at the positions whose tokens the step
    yields (``accepted + 1`` per row), in the shape ``LogprobsLists`` has
    when requests sample several tokens."""
    kept = [s + j for s, a in zip(rows.starts, num_accepted, strict=True) for j in range(a + 1)]
    index = torch.tensor(kept, dtype=torch.int64, device=logits.device)
    tensors = compute_logprobs(logits[index], position_tokens[index], num_top)
    wanted = [n for n, a in zip(per_row, num_accepted, strict=True) for _ in range(a + 1)]
    lists = tensors.to_lists(wanted)
    cu = np.zeros(num_reqs + 1, np.int64)
    cu[sample_rows + 1] = np.array(num_accepted, np.int64) + 1
    lists.cu_num_generated_tokens = np.cumsum(cu).tolist()
    return lists
