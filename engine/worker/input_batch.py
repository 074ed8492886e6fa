"""The persistent batch: per-request rows the model runner keeps across steps.

The scheduler sends a request in full once (NewRequestData) and then only
deltas (new blocks, progress). The runner keeps what it needs in
``CachedRequestState`` for every live request, and in dense numpy rows for
the requests scheduled this step, so building a step's inputs is a handful
of vectorized gathers rather than per-token Python.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the runner knows about one live request, scheduled or not."""

    req_id: str
    token_ids: list[int]  # prompt + outputs, as far as the runner knows
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: tuple[list[int], ...]  # one list per KV cache group
    num_computed_tokens: int
    # P/D: the prompt's last this-many tokens are output of an earlier leg
    # (Request.num_output_tokens_in_prompt); penalties count them as output.
    num_output_tokens_in_prompt: int = 0
    # The LoRA adapter it runs under (LoRARequest.lora_int_id; 0: none).
    lora_int_id: int = 0

    @property
    def output_start(self) -> int:
        """Position of the first token that is this request's output."""
        return self.num_prompt_tokens - self.num_output_tokens_in_prompt


@dataclass
class InputBatch:
    """Dense rows for the requests in this step; row order is output order.

    Removing a row moves the last row into the hole, so rows ``0..n-1`` are
    always the live ones.
    """

    max_num_reqs: int
    max_model_len: int
    max_blocks_per_req: int
    num_kv_groups: int = 1
    req_ids: list[str] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    states: list[CachedRequestState] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.max_num_reqs
        self.token_ids: npt.NDArray[np.int64] = np.zeros((n, self.max_model_len), np.int64)
        self.num_tokens: npt.NDArray[np.int64] = np.zeros(n, np.int64)
        self.num_computed_tokens: npt.NDArray[np.int64] = np.zeros(n, np.int64)
        # One block table per KV cache group; every group's row has the
        # same number of entries (a windowed group's freed ones are stale).
        self.block_tables: npt.NDArray[np.int32] = np.zeros(
            (self.num_kv_groups, n, self.max_blocks_per_req), np.int32
        )
        self.num_blocks: npt.NDArray[np.int64] = np.zeros(n, np.int64)
        # Per row, the position where output starts (see TokenHistory).
        self.output_start: npt.NDArray[np.int64] = np.zeros(n, np.int64)

    @property
    def block_table(self) -> npt.NDArray[np.int32]:
        """Group 0's block table (every layer's, with one group)."""
        table: npt.NDArray[np.int32] = self.block_tables[0]
        return table

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_index

    def add(self, state: CachedRequestState) -> None:
        row = len(self.req_ids)
        self.req_ids.append(state.req_id)
        self.req_id_to_index[state.req_id] = row
        self.states.append(state)
        self.set_tokens(row, state.token_ids)
        self.set_blocks(row, state.block_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.output_start[row] = state.output_start

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            self._move_row(last, row)
        self.req_ids.pop()
        self.states.pop()

    def _move_row(self, src: int, dst: int) -> None:
        moved = self.req_ids[src]
        self.req_ids[dst] = moved
        self.states[dst] = self.states[src]
        self.req_id_to_index[moved] = dst
        n_tok = int(self.num_tokens[src])
        self.token_ids[dst, :n_tok] = self.token_ids[src, :n_tok]
        self.num_tokens[dst] = n_tok
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        self.output_start[dst] = self.output_start[src]
        n_blk = int(self.num_blocks[src])
        self.block_tables[:, dst, :n_blk] = self.block_tables[:, src, :n_blk]
        self.num_blocks[dst] = n_blk

    def group_by_lora(self) -> None:
        """Reorders rows so each LoRA adapter's rows are contiguous (base
        rows first), as the batched LoRA kernels want them; a no-op when
        they already are, which is every step the batch did not change."""
        ids = [state.lora_int_id for state in self.states]
        if all(a <= b for a, b in itertools.pairwise(ids)):
            return
        order = sorted(range(len(ids)), key=ids.__getitem__)
        n = len(order)
        width = int(self.num_tokens[:n].max())
        blocks = int(self.num_blocks[:n].max())
        self.token_ids[:n, :width] = self.token_ids[order, :width]
        self.block_tables[:, :n, :blocks] = self.block_tables[:, order, :blocks]
        per_row = (self.num_tokens, self.num_computed_tokens, self.num_blocks, self.output_start)
        for array in per_row:
            array[:n] = array[order]
        self.req_ids = [self.req_ids[i] for i in order]
        self.states = [self.states[i] for i in order]
        self.req_id_to_index = {rid: row for row, rid in enumerate(self.req_ids)}

    def set_tokens(self, row: int, token_ids: list[int]) -> None:
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)

    def set_drafts(self, row: int, drafts: list[int]) -> None:
        """Write draft tokens after the row's tokens, where the step's input
        ids are gathered from, without counting them as its tokens."""
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(drafts)] = drafts

    def set_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table[row, : len(ids)] = ids
        self.num_blocks[row] = len(block_ids[0])

    def append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        start = int(self.num_blocks[row])
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table[row, start : start + len(ids)] = ids
        self.num_blocks[row] = start + len(block_ids[0])
