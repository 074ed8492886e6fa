"""A draft model proposer: a smaller model of the same vocabulary drafts
``k`` tokens per step, greedily, for every request that sampled.

It runs Tandem's own model code over its own paged KV cache, laid out in
the same blocks as the target's: a request's block ``b`` holds the target's
KV in the target's cache and the draft's KV in the draft's, so the block
tables, prefix caching and preemption need nothing of their own.

Per step, one catch-up forward computes, for each request, the tokens its
draft KV lacks (the tokens accepted since its last proposal and the one
sampled after them; on first sight, its whole prompt past the prefix-cache
hit) and takes the argmax at the last as the first draft. ``k - 1``
single-token forwards then draft the rest. Their KV lands in slots past the
verified tokens, which the scheduler allocates as lookahead slots (except
on a request's first step: it is admitted without them, for P/D block
parity, and a draft position past its blocks writes to the null block).

Draft KV only steers what is proposed: wrong or missing draft KV lowers the
acceptance rate, never changes an output (the target verifies every draft).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from engine.spec_decode.proposer import ProposeInputs
from kernels.metadata import AttentionMetadata
from kernels.sampling import greedy

if TYPE_CHECKING:
    from engine.worker.input_batch import InputBatch
    from engine.worker.model_runner import CausalLM


class DraftModelProposer:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        k: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.k = k
        self.device = device
        # Per request: how many leading tokens have valid draft KV.
        self.valid: dict[str, int] = {}

    def reset(self, req_id: str, num_valid: int) -> None:
        self.valid[req_id] = num_valid

    def remove(self, req_id: str) -> None:
        self.valid.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, inputs: ProposeInputs) -> list[list[int]]:
        batch = inputs.batch
        wanted = np.flatnonzero(inputs.max_drafts > 0)
        drafts: list[list[int]] = [[] for _ in range(inputs.rows.size)]
        if wanted.size == 0:
            return drafts
        rows = inputs.rows[wanted]
        req_ids = [batch.req_ids[r] for r in rows.tolist()]
        ends = batch.num_tokens[rows]
        starts = np.array([self.valid.get(rid, 0) for rid in req_ids], np.int64)
        # At least the newest token goes in: its logits give the first draft.
        starts = np.minimum(starts, ends - 1)
        table = self._block_table(batch, rows)
        steps = int(inputs.max_drafts[wanted].max())
        tokens = self._catch_up(batch, rows, starts, ends, table)
        proposed = [tokens]
        for j in range(1, steps):
            tokens = self._decode(tokens, ends - 1 + j, table)
            proposed.append(tokens)
        for rid, end in zip(req_ids, ends.tolist(), strict=True):
            self.valid[rid] = end
        columns = torch.stack(proposed, dim=1).tolist()
        caps = inputs.max_drafts[wanted].tolist()
        for i, row_drafts, cap in zip(wanted.tolist(), columns, caps, strict=True):
            drafts[i] = row_drafts[:cap]
        return drafts

    def _block_table(self, batch: InputBatch, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """The rows' block tables, entries past their allocated blocks
        pointing at the null block (a stale entry is another request's)."""
        width = int(batch.num_blocks[rows].max())
        table = batch.block_table[rows, :width].copy()
        table[np.arange(width)[None, :] >= batch.num_blocks[rows][:, None]] = 0
        return table

    def _slots(
        self,
        table: npt.NDArray[np.int32],
        req_idx: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
    ) -> npt.NDArray[np.int64]:
        block = positions // self.block_size
        inside = block < table.shape[1]
        ids = table[req_idx, np.minimum(block, table.shape[1] - 1)].astype(np.int64)
        ids = np.where(inside, ids, 0)  # past every allocated block: the null block
        return ids * self.block_size + positions % self.block_size

    def _catch_up(
        self,
        batch: InputBatch,
        rows: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        table: npt.NDArray[np.int32],
    ) -> torch.Tensor:
        lens = ends - starts
        cu = np.cumsum(lens)
        req_idx = np.repeat(np.arange(rows.size), lens)
        positions = np.repeat(starts, lens) + np.arange(int(cu[-1])) - np.repeat(cu - lens, lens)
        input_ids = batch.token_ids[rows[req_idx], positions]
        slots = self._slots(table, req_idx, positions)
        hidden = self._forward(input_ids, positions, slots, lens, ends, table)
        last = torch.from_numpy(cu - 1).to(self.device)
        return greedy(self.model.compute_logits(hidden[last]))

    def _decode(
        self, tokens: torch.Tensor, positions: npt.NDArray[np.int64], table: npt.NDArray[np.int32]
    ) -> torch.Tensor:
        n = positions.size
        req_idx = np.arange(n)
        slots = self._slots(table, req_idx, positions)
        hidden = self._forward(tokens, positions, slots, np.ones(n, np.int64), positions + 1, table)
        return greedy(self.model.compute_logits(hidden))

    def _forward(
        self,
        input_ids: npt.NDArray[np.int64] | torch.Tensor,
        positions: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int64],
        query_lens: npt.NDArray[np.int64],
        seq_lens: npt.NDArray[np.int64],
        table: npt.NDArray[np.int32],
    ) -> torch.Tensor:
        dev = self.device
        query_start_loc = np.zeros(query_lens.size + 1, np.int32)
        query_start_loc[1:] = np.cumsum(query_lens)
        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // self.block_size)
        if max_blocks > table.shape[1]:  # lookahead positions past the table
            table = np.pad(table, ((0, 0), (0, max_blocks - table.shape[1])))
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(table[:, :max_blocks])).to(dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=max_seq_len,
            decode_only=bool(query_lens.max() == 1),
        )
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.from_numpy(input_ids)
        hidden: torch.Tensor = self.model(
            ids.to(dev), torch.from_numpy(positions).to(dev), self.kv_caches, meta
        )
        return hidden
