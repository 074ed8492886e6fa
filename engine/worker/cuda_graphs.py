"""CUDA graphs for decode steps: capture the forward once per padded batch
size, then each step fills persistent input buffers and replays.

On a GPU a small model's decode step is launch-bound: hundreds of kernels,
each a few microseconds of work behind ~10 us of Python and driver. A graph
replays the whole forward as one launch.

What is captured: the model's forward (hidden states) for a batch of
*decode rows*: token rows that each attend to their own context up to
their own position. A plain decode step is one row per request; a step
verifying speculative drafts is one row per token (the model runner's
``_token_rows_metadata`` lays it out that way), so both replay the same
graphs. Steps with prefill chunks run eagerly: their token counts vary
too much for a size list, and their cost is matmuls, not launches (vLLM's
piecewise graphs would capture around attention; not worth it here). Steps
with LoRA rows also run eagerly: the adapters' segments are host-side
Python (``kernels.lora``). The logits and the sampler run after the replay,
on the real rows only.

Padding rows (``padded - rows`` of them) compute on token 0 at position 0
with a context of one token, whose K/V they write into slot 0 of the null
block (block 0, which the block pool never hands out): they change no slot
a request owns, and a request never reads the null block except at
positions its window masks.

The captured attention metadata says ``max_seq_len = max_model_len``: the
kernels size their grids (and the Triton kernel its KV splits) from it,
and each program bounds its loop by its own sequence's length, so one
graph serves every context length.

Memory: all graphs share one pool, captured largest first so smaller ones
reuse its memory. The worker measures what capturing takes (on a two-block
KV cache) before the KV budget is counted, and captures the real graphs
once the cache exists (engine/worker/worker.py).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from engine.worker.input_batch import InputBatch
from kernels.metadata import AttentionMetadata

# vLLM's default cap on captured sizes.
MAX_DEFAULT_CAPTURE = 512
# Where padding rows write their K/V: the null block's first slot.
PAD_SLOT = 0


def capture_sizes(max_rows: int, given: Sequence[int] | None = None) -> tuple[int, ...]:
    """The batch sizes (token rows) to capture, ascending.

    ``given`` None: vLLM's list, 1, 2, 4, then steps of 8, up to
    ``min(max_rows, 512)``, plus that cap itself. One value: the same list
    up to that value. Several: those sizes. Sizes past the first that holds
    ``max_rows`` are dropped: no step has that many decode rows.
    """
    if given is not None and len(given) > 1:
        sizes = sorted(set(given))
    else:
        cap = given[0] if given else min(max_rows, MAX_DEFAULT_CAPTURE)
        small = {n for n in (1, 2, 4) if n <= cap}
        sizes = sorted(small | set(range(8, cap + 1, 8)) | {cap})
    covering = next((n for n in sizes if n >= max_rows), sizes[-1])
    return tuple(n for n in sizes if n <= covering)


def padded_size(sizes: Sequence[int], rows: int) -> int | None:
    """The smallest captured size holding ``rows`` rows; None when no
    graph is that large (the step runs eagerly)."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class DecodeRows:
    """One step's decode rows, host side: what the buffers are filled from."""

    input_ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]  # each row's context is positions + 1 tokens
    slot_mapping: npt.NDArray[np.int64]  # [KV cache groups, rows]
    table_rows: npt.NDArray[np.int64]  # the batch row whose block table each row reads
    max_blocks: int  # block-table columns any row reads

    @property
    def num_rows(self) -> int:
        return int(self.positions.size)


Replay = Callable[[], torch.Tensor]


class GraphCapture(Protocol):
    """Turns a forward over the static buffers into something replayable."""

    def capture(self, forward: Replay) -> Replay: ...


class CudaGraphCapture:
    """Captures into CUDA graphs that share one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, forward: Replay) -> Replay:
        # Once outside the graph first: Triton compiles its kernels and the
        # allocator grows, neither of which may happen during capture.
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerCapture:
    """A 'capture' whose replay calls the forward again: the static-buffer
    bookkeeping without CUDA (unit tests on CPU)."""

    def capture(self, forward: Replay) -> Replay:
        return forward


class StaticInputs:
    """The persistent device buffers a captured forward reads, for up to
    ``max_rows`` rows over ``num_groups`` block tables."""

    def __init__(
        self, max_rows: int, num_groups: int, max_blocks: int, device: torch.device
    ) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_rows, dtype=torch.int64)
        self.positions = zeros(max_rows, dtype=torch.int64)
        self.slot_mapping = zeros(num_groups, max_rows, dtype=torch.int64)
        # One token of context (a padding row's) until filled: the capture's
        # own run then reads the null block, never an empty context.
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        # One token per row: the query offsets never change.
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.block_tables = zeros(num_groups, max_rows, max_blocks, dtype=torch.int32)

    def metas(self, rows: int, max_model_len: int) -> list[AttentionMetadata]:
        """Per KV cache group, the metadata of a ``rows``-row decode over views
        of the buffers."""
        return [
            AttentionMetadata(
                slot_mapping=self.slot_mapping[g, :rows],
                query_start_loc=self.query_start_loc[: rows + 1],
                seq_lens=self.seq_lens[:rows],
                block_table=self.block_tables[g, :rows],
                max_query_len=1,
                max_seq_len=max_model_len,
                decode_only=True,
            )
            for g in range(self.slot_mapping.shape[0])
        ]

    def fill(self, step: DecodeRows, padded: int, batch: InputBatch) -> None:
        """This step's rows, then padding rows up to ``padded``: token 0 at
        position 0, one token of context in the null block."""
        n = step.num_rows
        pad = padded - n
        ids = np.concatenate([step.input_ids, np.zeros(pad, np.int64)])
        positions = np.concatenate([step.positions, np.zeros(pad, np.int64)])
        slots = np.concatenate(
            [step.slot_mapping, np.full((step.slot_mapping.shape[0], pad), PAD_SLOT, np.int64)],
            axis=1,
        )
        tables = np.zeros((batch.num_kv_groups, padded, step.max_blocks), np.int32)
        tables[:, :n] = batch.block_tables[:, step.table_rows, : step.max_blocks]
        _copy(self.input_ids[:padded], ids)
        _copy(self.positions[:padded], positions)
        _copy(self.seq_lens[:padded], (positions + 1).astype(np.int32))
        _copy(self.slot_mapping[:, :padded], slots)
        _copy(self.block_tables[:, :padded, : step.max_blocks], tables)


def _copy(dst: torch.Tensor, src: npt.NDArray[np.generic]) -> None:
    dst.copy_(torch.from_numpy(src), non_blocking=True)


Forward = Callable[
    [torch.Tensor, torch.Tensor, list[AttentionMetadata]],
    torch.Tensor,
]


class DecodeGraphs:
    """The captured decode forwards, one per size, and running a step on one.

    ``forward(input_ids, positions, metas)`` is the model runner's forward
    (metas: one per KV cache group) and must read nothing from the host
    that changes between steps.
    """

    def __init__(
        self,
        forward: Forward,
        sizes: Sequence[int],
        inputs: StaticInputs,
        max_model_len: int,
    ) -> None:
        self.forward = forward
        self.sizes = tuple(sorted(sizes))
        self.inputs = inputs
        self.max_model_len = max_model_len
        self.replays: dict[int, Replay] = {}
        # Steps replayed, by padded size (tests and benchmarks read it).
        self.replayed: Counter[int] = Counter()

    def capture_all(self, capture: GraphCapture) -> None:
        """Captures every size, largest first (smaller graphs then fit in
        the memory the largest left in the shared pool)."""
        for size in reversed(self.sizes):
            self.replays[size] = capture.capture(self._forward_of(size))

    def _forward_of(self, size: int) -> Replay:
        inputs = self.inputs
        metas = inputs.metas(size, self.max_model_len)
        ids, positions = inputs.input_ids[:size], inputs.positions[:size]

        def forward() -> torch.Tensor:
            return self.forward(ids, positions, metas)

        return forward

    def padded_size(self, rows: int) -> int | None:
        return padded_size(self.sizes, rows)

    def run(self, step: DecodeRows, batch: InputBatch) -> torch.Tensor | None:
        """Hidden states of the step's rows ([rows, hidden], a view of the
        graph's output: valid until the next replay), or None when no
        captured size holds them."""
        padded = self.padded_size(step.num_rows)
        if padded is None or padded not in self.replays:
            return None
        self.inputs.fill(step, padded, batch)
        self.replayed[padded] += 1
        return self.replays[padded]()[: step.num_rows]
