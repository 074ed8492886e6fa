"""Logit adjustments applied before choosing, to greedy rows too: the
per-request ``logit_bias``, then the repetition, frequency and presence
penalties (vLLM v1's order).

Penalties need each row's tokens and their counts. They are rebuilt every
step, on the device, from the runner's persistent token rows: one gather of
the rows that use penalties, one host-to-device copy of their token ids, a
sort of each row's output ids (runs of equal ids give the counts). They are
applied with a gather and scatters at those ids, so the work grows with the
rows' tokens, not with ``rows x vocab`` (dense ``[rows, vocab]`` count bins
cost ~15 full passes over the logits: 16x a greedy step on the CPU). This is
stateless, so it stays right through preemption, resumption, row moves and
P/D handovers with nothing to keep in step, and needs no persistent
``[max_num_reqs, vocab]`` device bins, memory the KV-cache sizing did not
leave room for. Only rows that ask for a penalty pay anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """The tokens each sampling row has so far, as the runner holds them.

    Views of the runner's persistent batch (nothing is copied to make one):
    batch row ``b`` holds ``token_ids[b, :num_tokens[b]]``, of which those
    from ``output_start[b]`` on are output (with P/D, output an earlier leg
    generated counts too). Sampling row ``i`` is batch row ``rows[i]``.
    """

    token_ids: npt.NDArray[np.int64]  # [B, max_len]
    num_tokens: npt.NDArray[np.int64]  # [B]
    output_start: npt.NDArray[np.int64]  # [B]
    rows: npt.NDArray[np.int64]  # [N]
    # Speculative decoding: per sampling row, how many tokens after the
    # batch row's own count belong to its history (the drafts before the
    # position it samples at; they sit in token_ids right after). None: 0.
    extra: npt.NDArray[np.int64] | None = None

    @classmethod
    def from_lists(cls, prompts: Sequence[list[int]], outputs: Sequence[list[int]]) -> TokenHistory:
        """One batch row per sampling row (tests and the offline tools)."""
        rows = [p + o for p, o in zip(prompts, outputs, strict=True)]
        width = max((len(r) for r in rows), default=0)
        token_ids = np.zeros((len(rows), width), np.int64)
        for i, r in enumerate(rows):
            token_ids[i, : len(r)] = r
        return cls(
            token_ids=token_ids,
            num_tokens=np.array([len(r) for r in rows], np.int64),
            output_start=np.array([len(p) for p in prompts], np.int64),
            rows=np.arange(len(rows), dtype=np.int64),
        )


@dataclass
class LogitBiasTensors:
    """Every (row, token, bias) of the rows with a logit_bias, flattened."""

    rows: torch.Tensor  # [M] int64
    token_ids: torch.Tensor  # [M] int64
    biases: torch.Tensor  # [M] float32

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], device: torch.device | str
    ) -> LogitBiasTensors | None:
        rows: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for i, p in enumerate(params):
            bias = p.logit_bias
            if bias:
                rows.extend([i] * len(bias))
                token_ids.extend(bias.keys())
                biases.extend(bias.values())
        if not rows:
            return None
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            biases=torch.tensor(biases, dtype=torch.float32, device=device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` plus the biases, as a new tensor (ids are distinct per
        row, so accumulating adds each bias once)."""
        return logits.index_put((self.rows, self.token_ids), self.biases, accumulate=True)


@dataclass
class PenaltyTensors:
    """The penalty rows' parameters and token ids, on the device, ready to
    apply with a gather and scatters over the tokens, not the vocabulary.

    Only the ``P`` sampling rows with a penalty are here; ``rows`` maps them
    to sampling rows (None when every row has one). A kind of penalty no
    row uses is None, and so is what only it needs.
    """

    rows: torch.Tensor | None  # [P] int64
    repetition: torch.Tensor | None  # [P, 1] float32
    # [P, W] int64: each row's prompt and output tokens; padding repeats the
    # row's first token, which is penalized anyway.
    seen_ids: torch.Tensor | None
    # [P, W] int64: each row's output tokens, sorted (padding: 0, adding 0).
    output_ids: torch.Tensor | None
    # [P, W] float32, what to add at output_ids: on the last entry of each
    # run of equal ids, -(frequency * count) and -presence; 0 elsewhere, so
    # each (row, token) gets exactly one non-zero addend (exact and
    # deterministic under scatter_add, even with atomics).
    frequency_add: torch.Tensor | None
    presence_add: torch.Tensor | None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        history: TokenHistory,
        device: torch.device | str,
    ) -> PenaltyTensors | None:
        picked = [i for i, p in enumerate(params) if p.uses_penalties]
        if not picked:
            return None
        # Three host-to-device copies in all (each small copy costs a sync
        # on a GPU): the penalties, the per-row ints, the token ids.
        values = np.array(
            [
                (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                for p in (params[i] for i in picked)
            ],
            np.float32,
        )
        used = (values != np.array([1.0, 0.0, 0.0], np.float32)).any(axis=0)
        batch_rows = history.rows[picked]
        num_tokens = history.num_tokens[batch_rows]
        if history.extra is not None:
            num_tokens = num_tokens + history.extra[picked]
        output_start = history.output_start[batch_rows]
        # Without a repetition penalty no prompt token matters: skip them.
        first = 0 if used[0] else int(output_start.min())
        last = int(num_tokens.max())
        ints = _to_device(np.stack([np.array(picked), num_tokens, output_start], axis=1), device)
        columns = _to_device(values, device)
        token_ids = _to_device(history.token_ids[batch_rows, first:last], device)
        positions = torch.arange(first, last, device=device)
        end = ints[:, 1:2]
        repetition = columns[:, 0:1] if used[0] else None
        seen_ids = output_ids = frequency_add = presence_add = None
        if repetition is not None:
            # first == 0 here, and every row has a token (a prompt is never empty).
            seen_ids = torch.where(positions < end, token_ids, token_ids[:, :1])
        if used[1] or used[2]:
            in_output = (positions >= ints[:, 2:3]) & (positions < end)
            output_ids, last_of_run, counts = _runs(token_ids, in_output)
            zero = torch.zeros((), dtype=torch.float32, device=device)
            if used[1]:
                frequency_add = torch.where(last_of_run, -(columns[:, 1:2] * counts), zero)
            if used[2]:
                presence_add = torch.where(last_of_run, -columns[:, 2:3], zero)
        return cls(
            rows=None if len(picked) == len(params) else ints[:, 0],
            repetition=repetition,
            seen_ids=seen_ids,
            output_ids=output_ids,
            frequency_add=frequency_add,
            presence_add=presence_add,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the penalty rows penalized, as a new tensor; the
        other rows are copied bit for bit. Repetition first, then frequency,
        then presence (vLLM's order)."""
        rows = self.rows
        target = logits.clone() if rows is None else logits.index_select(0, rows)
        if self.repetition is not None:
            assert self.seen_ids is not None  # built together
            values = target.gather(1, self.seen_ids)
            penalized = torch.where(values > 0, values / self.repetition, values * self.repetition)
            # Repeated ids write the same value: the result is well defined.
            target.scatter_(1, self.seen_ids, penalized)
        if self.output_ids is not None:
            if self.frequency_add is not None:
                target.scatter_add_(1, self.output_ids, self.frequency_add)
            if self.presence_add is not None:
                target.scatter_add_(1, self.output_ids, self.presence_add)
        return target if rows is None else logits.index_copy(0, rows, target)


_PAD = torch.iinfo(torch.int64).max  # sorts after every token id


def _runs(
    token_ids: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept ids of each row sorted (others as 0), where each run of
    equal ids ends, and the run's length there (float32)."""
    ids = token_ids.masked_fill(~keep, _PAD).sort(dim=1).values
    pad = torch.full_like(ids[:, :1], _PAD)
    real = ids != _PAD
    last_of_run = real & (ids != torch.cat([ids[:, 1:], pad], dim=1))
    first_of_run = ids != torch.cat([pad, ids[:, :-1]], dim=1)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    run_start = torch.where(first_of_run, positions, 0).cummax(dim=1).values
    counts = (positions - run_start + 1).to(torch.float32)
    return ids.masked_fill(~real, 0), last_of_run, counts


def _to_device(array: npt.NDArray[Any], device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)
