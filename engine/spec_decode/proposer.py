"""What a proposer is to the model runner, and the n-gram one behind it.

After a step samples, the runner asks its proposer for the next step's
drafts of the rows that sampled. The drafts go to the scheduler
(``update_draft_token_ids``), which schedules them with the request's next
token; the runner then verifies them (engine/spec_decode/rejection.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from engine.worker.input_batch import InputBatch


@dataclass(frozen=True)
class ProposeInputs:
    """One step, as far as a proposer needs it (all host arrays).

    ``rows``: batch rows that sampled this step (their new tokens are in
    the batch already); ``max_drafts[i]``: at most this many drafts for
    ``rows[i]`` (k, less near the request's max_tokens).
    """

    batch: InputBatch
    rows: npt.NDArray[np.int64]
    max_drafts: npt.NDArray[np.int64]


class Proposer(Protocol):
    def propose(self, inputs: ProposeInputs) -> list[list[int]]:
        """Drafts for each of ``inputs.rows`` (maybe none), in order."""
        ...

    def reset(self, req_id: str, num_valid: int) -> None:
        """The request is new or resumed: the first ``num_valid`` tokens'
        KV in its blocks are valid (prefix-cache hits), the rest is not."""
        ...

    def remove(self, req_id: str) -> None:
        """The request finished: forget it."""
        ...


class NgramLookup:
    """Prompt lookup over the batch's token rows (no model, no state)."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.ngram = NgramProposer(k, min_n, max_n)

    def propose(self, inputs: ProposeInputs) -> list[list[int]]:
        batch = inputs.batch
        n = batch.num_reqs
        # Rows that did not sample get length 0: the lookup skips them.
        lengths = np.zeros(n, np.int64)
        lengths[inputs.rows] = batch.num_tokens[inputs.rows]
        # A view of the live rows, no copy: each is read to its length only.
        drafts = self.ngram.propose(batch.token_ids[:n], lengths)
        caps = inputs.max_drafts.tolist()
        return [drafts[r][:cap] for r, cap in zip(inputs.rows.tolist(), caps, strict=True)]

    def reset(self, req_id: str, num_valid: int) -> None:
        pass

    def remove(self, req_id: str) -> None:
        pass
