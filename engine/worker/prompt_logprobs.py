"""Prompt logprobs: each prompt token's logprob given the tokens before it.

The runner computes logits only for the rows that sample. A request with
``SamplingParams.prompt_logprobs`` also needs them at its prompt positions:
position ``p``'s logits give the logprob of prompt token ``p + 1``. Chunked
prefill spreads a prompt over steps, so each step computes the rows of the
positions its chunk covers and hands them out at once
(``ModelRunnerOutput.prompt_logprobs_dict``); the front end puts the chunks
together. Full-vocabulary logits exist for at most ``ROWS_PER_PASS`` rows at a
time, however long the chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

from engine.outputs import LogprobsLists, PromptLogprobs
from engine.worker.input_batch import InputBatch
from engine.worker.sampler import compute_logprobs

# Rows of full-vocabulary logits (and their log-softmax) alive at once:
# 512 x a 128k vocabulary in float32 is 256 MB, and a chunk may be 8k rows.
ROWS_PER_PASS = 512

ComputeLogits = Callable[[torch.Tensor], torch.Tensor]


class PromptLogprobsTracker:
    """The live requests whose prompt logprobs are not all computed yet.

    A request leaves once a step reaches its last prompt position; one
    preempted before that computes its prompt again and gives those rows
    again (the front end keeps one per position).
    """

    def __init__(self) -> None:
        self._num_top: dict[str, int] = {}  # request id -> top alternatives asked for

    def __bool__(self) -> bool:
        return bool(self._num_top)

    def add(self, req_id: str, num_top: int | None, num_prompt_tokens: int) -> None:
        """A new request; ``num_top`` None: it asked for none. A one-token
        prompt has none to compute (its only token has no context)."""
        self._num_top.pop(req_id, None)
        if num_top is not None and num_prompt_tokens > 1:
            self._num_top[req_id] = num_top

    def remove(self, req_id: str) -> None:
        self._num_top.pop(req_id, None)

    def compute(
        self,
        hidden: torch.Tensor,
        batch: InputBatch,
        query_start_loc: npt.NDArray[np.int32],
        num_scheduled_tokens: dict[str, int],
        compute_logits: ComputeLogits,
    ) -> dict[str, PromptLogprobs]:
        """This step's prompt logprobs of every tracked request it scheduled.

        ``hidden`` holds the step's token rows; a request's rows start at
        ``query_start_loc[row]`` and cover positions from its
        ``num_computed_tokens`` on (both as ``prepare_inputs`` built them).
        """
        out: dict[str, PromptLogprobs] = {}
        for req_id, num_top in list(self._num_top.items()):
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                continue  # not scheduled this step
            start = int(batch.num_computed_tokens[row])
            last = batch.states[row].num_prompt_tokens - 1  # the last position with a target
            end = min(start + num_scheduled_tokens[req_id], last)
            if end >= last:
                del self._num_top[req_id]
            if end <= start:
                continue
            offset = int(query_start_loc[row])
            targets = torch.from_numpy(batch.token_ids[row, start + 1 : end + 1])
            rows = hidden[offset : offset + end - start]
            lists = token_logprobs(compute_logits, rows, targets.to(hidden.device), num_top)
            out[req_id] = PromptLogprobs(first_token=start + 1, logprobs=lists)
        return out


def token_logprobs(
    compute_logits: ComputeLogits, hidden: torch.Tensor, targets: torch.Tensor, num_top: int
) -> LogprobsLists:
    """Row ``i``: the logprob and rank of ``targets[i]`` under the logits of
    ``hidden[i]``, and the ``num_top`` most likely tokens, computed
    ``ROWS_PER_PASS`` rows at a time."""
    ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    ranks: list[int] = []
    for begin in range(0, hidden.shape[0], ROWS_PER_PASS):
        logits = compute_logits(hidden[begin : begin + ROWS_PER_PASS])
        part = compute_logprobs(logits, targets[begin : begin + ROWS_PER_PASS], num_top).to_lists()
        ids.extend(part.logprob_token_ids)
        logprobs.extend(part.logprobs)
        ranks.extend(part.sampled_token_ranks)
    return LogprobsLists(ids, logprobs, ranks)
