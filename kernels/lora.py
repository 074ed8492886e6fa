"""Batched LoRA: add each row's adapter delta to a linear layer's output.

A step's batch mixes requests under different adapters and requests on the
base model. The model runner groups rows by adapter (engine/lora/), so each
adapter in a step owns one contiguous run of token rows, a *segment*, and
rows outside every segment are base-model rows. For a projection with
adapter weights stacked per device slot, ``A [slots, R, in]`` and
``B [slots, out, R]`` (the scaling folded into B), each segment gets

    y[start:end] += (x[start:end] @ A[slot].T) @ B[slot].T

which is SGMV (segmented gather matrix-vector) as Punica and vLLM call it:
one low-rank product per adapter in the step, never one per row, and the
base rows cost nothing. On a CPU a step with several adapters does all of
them in two batched products (``torch.bmm`` over the slots, each slot's
rows padded to the longest segment): at batch 64 over 8 adapters, the
per-segment loop's 16 small matmuls per projection cost 3x as much. Fused
projections (q/k/v, gate/up) stack their shards' A rows (``R = shards *
max_rank``) and lay each shard's B in its own columns, so one product covers
every slice.

``apply_lora`` picks the implementation: the Triton kernel
(kernels/triton_lora.py) for CUDA tensors, torch's matmuls otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoRASegment:
    """Token rows ``start:end`` run the adapter in device slot ``slot``."""

    start: int
    end: int
    slot: int


@dataclass(frozen=True)
class PaddedRows:
    """The step's adapter rows laid out as ``[slots hi - lo, width]`` for
    batched products over the slot range ``lo:hi``: ``index`` [slots *
    width] picks each position's token row (padding picks row 0), ``mask``
    [slots, width, 1] zeroes the padding's shrunk rows (None: no padding),
    and ``in_order`` says the index is 0..T-1 (no gather, no scatter)."""

    lo: int
    hi: int
    width: int
    index: torch.Tensor
    mask: torch.Tensor | None
    in_order: bool


@dataclass
class LoRABatch:
    """Which token rows of this step run which adapter slot (sorted, disjoint)."""

    segments: list[LoRASegment]
    num_tokens: int
    _token_slots: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    _padded: list[PaddedRows | None] = field(default_factory=list, repr=False)

    def padded(self) -> PaddedRows | None:
        """The batched layout (built once per step), or None when a loop over
        segments is cheaper: one adapter, or padding would more than double
        the rows (a long prefill next to short decodes)."""
        if not self._padded:
            self._padded.append(self._build_padded())
        return self._padded[0]

    def _build_padded(self) -> PaddedRows | None:
        segs = self.segments
        if len(segs) < 2 or len({s.slot for s in segs}) < len(segs):
            return None
        lo, hi = min(s.slot for s in segs), max(s.slot for s in segs) + 1
        width = max(s.end - s.start for s in segs)
        if (hi - lo) * width > 2 * sum(s.end - s.start for s in segs):
            return None
        index = torch.zeros((hi - lo) * width, dtype=torch.int64)
        valid = torch.zeros((hi - lo) * width, dtype=torch.bool)
        for seg in segs:
            at = (seg.slot - lo) * width
            index[at : at + seg.end - seg.start] = torch.arange(seg.start, seg.end)
            valid[at : at + seg.end - seg.start] = True
        in_order = bool(valid.all()) and index.size(0) == self.num_tokens
        in_order = in_order and bool((index == torch.arange(self.num_tokens)).all())
        mask = None if bool(valid.all()) else valid.view(hi - lo, width, 1).float()
        return PaddedRows(lo, hi, width, index, mask, in_order)

    def token_slots(self, device: torch.device) -> torch.Tensor:
        """int32 [num_tokens]: each row's slot, -1 for base-model rows (the
        per-row form GPU kernels index by), built once per step and device."""
        slots = self._token_slots.get(device)
        if slots is None:
            host = torch.full((self.num_tokens,), -1, dtype=torch.int32)
            for seg in self.segments:
                host[seg.start : seg.end] = seg.slot
            slots = host.to(device)
            self._token_slots[device] = slots
        return slots


def lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: LoRABatch,
) -> None:
    """The reference (and CPU) path: in place, ``y[seg] += x[seg] @ A.T @ B.T``."""
    padded = batch.padded()
    if padded is not None:
        _lora_padded(y, x, a, b, padded)
        return
    for seg in batch.segments:
        rows = slice(seg.start, seg.end)
        shrunk = torch.mm(x[rows], a[seg.slot].t())
        y[rows].addmm_(shrunk.to(y.dtype), b[seg.slot].t())


def _lora_padded(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: PaddedRows
) -> None:
    """Every segment at once: one bmm over the slot range shrinks, one
    expands, straight into ``y`` when the rows are in order (else into a
    buffer added at the rows' places). A fused projection's B is
    block-diagonal, so the expand multiplies zeros too; one product per
    shard instead measured slower at batch 64 (strided outputs, more calls)."""
    slots, width = rows.hi - rows.lo, rows.width
    xs = x if rows.in_order else x.index_select(0, rows.index)
    shrunk = torch.bmm(xs.reshape(slots, width, -1), a[rows.lo : rows.hi].transpose(1, 2))
    if rows.mask is not None:
        shrunk.mul_(rows.mask.to(shrunk.dtype))  # padding rows add nothing
    expand = b[rows.lo : rows.hi].transpose(1, 2)
    if rows.in_order:
        y.view(slots, width, -1).baddbmm_(shrunk.to(y.dtype), expand)
    else:
        delta = torch.bmm(shrunk.to(y.dtype), expand)
        y.index_add_(0, rows.index, delta.view(slots * width, -1))


def apply_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: LoRABatch,
) -> None:
    """Adds the batch's adapter deltas to ``y`` [T, out] in place, for
    ``x`` [T, in] and one projection's slot weights ``a`` [S, R, in],
    ``b`` [S, out, R]."""
    if not batch.segments:
        return
    if y.is_cuda:
        from kernels.triton_lora import lora_triton

        lora_triton(y, x, a, b, batch)
        return
    lora_torch(y, x, a, b, batch)


@dataclass
class LoRAState:
    """The step's ``LoRABatch``, shared by every adapted layer of one model:
    the model runner sets it before a forward that has adapter rows and
    clears it after (None: a base-model step, adapters cost nothing)."""

    batch: LoRABatch | None = None


@dataclass(frozen=True)
class LoRALayer:
    """One projection's device slots: ``a`` [slots, R, in], ``b`` [slots, out, R]."""

    a: torch.Tensor
    b: torch.Tensor
    state: LoRAState

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        batch = self.state.batch
        if batch is not None:
            apply_lora(y, x, self.a, self.b, batch)
