"""Verifying drafts: which of a request's draft tokens the target accepts,
and the token that follows them, so outputs are distributed exactly as the
target model's.

A request with ``k`` drafts has ``k + 1`` consecutive rows of target
logits: row ``j`` is the target's distribution ``p_j`` after the drafts
before ``j``. Both proposers draft one token each (n-gram lookup copies,
the draft model takes its argmax), so the draft distribution ``q`` is
one-hot and the standard rule (Leviathan et al., 2023) becomes:

- greedy rows accept draft ``d_j`` while it is the argmax of ``p_j``;
- random rows accept ``d_j`` with probability ``min(1, p_j(d_j) / 1)``;
  at the first rejection they sample from the residual ``max(0, p_j - q)``
  normalised, which is ``p_j`` without ``d_j``;
- a row that accepts all ``k`` samples one more token from ``p_k`` (the
  bonus). Either way a step yields ``accepted + 1`` tokens.

Then P(token = x) = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d]
= p(x) at every position. Seeded rows draw their uniforms, then their
final sample, from their own generator, so they stay reproducible.
Everything is batched: one pass over all rows, no per-request loop but
the final split into lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.sampling import draw, greedy


@dataclass(frozen=True)
class DraftRows:
    """How a step's sampling rows map onto its logits rows.

    Sampling row ``i`` owns logits rows ``starts[i] .. starts[i] +
    len(drafts[i])`` (its drafts' positions, then the bonus position).
    """

    drafts: list[list[int]]
    starts: list[int]

    @classmethod
    def build(cls, drafts: Sequence[list[int]]) -> DraftRows:
        starts, at = [], 0
        for d in drafts:
            starts.append(at)
            at += len(d) + 1
        return cls(list(drafts), starts)

    @property
    def num_logits_rows(self) -> int:
        return self.starts[-1] + len(self.drafts[-1]) + 1 if self.drafts else 0


@dataclass(frozen=True)
class Verified:
    """Per sampling row, the tokens the step yields (accepted drafts, then
    one more); ``position_tokens[r]`` is the token chosen at logits row
    ``r`` (meaningless after a row's first rejection), for logprobs."""

    tokens: list[list[int]]
    num_accepted: list[int]
    position_tokens: torch.Tensor  # [M] int64


def verify(
    logits: torch.Tensor,
    rows: DraftRows,
    greedy_rows: torch.Tensor | None,
    probs: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> Verified:
    """Accept or reject every row's drafts.

    ``logits`` [M, V]: adjusted target logits (bias, penalties, grammar),
    greedy rows read their argmax. ``probs`` [M, V]: the random rows'
    sampling distribution (temperature, top-k/p, min-p applied); None when
    every row is greedy. ``greedy_rows`` [N] bool, None when all rows are
    of one kind. ``generators``: sampling row -> its seeded generator.
    """
    device = logits.device
    n = len(rows.drafts)
    k_max = max((len(d) for d in rows.drafts), default=0)
    num_drafts = torch.tensor([len(d) for d in rows.drafts], dtype=torch.int64)
    starts = torch.tensor(rows.starts, dtype=torch.int64)
    # [N, K] drafts and the logits row each was proposed for; padding -1.
    valid = torch.arange(k_max)[None, :] < num_drafts[:, None]
    padded = torch.full((n, k_max), -1, dtype=torch.int64)
    # Row-major order of the mask is the order of the concatenated drafts.
    padded[valid] = torch.tensor([t for d in rows.drafts for t in d], dtype=torch.int64)
    at = (starts[:, None] + torch.arange(k_max)[None, :]).clamp(max=max(logits.shape[0] - 1, 0))
    accept = torch.zeros((n, k_max), dtype=torch.bool)
    all_greedy = probs is None
    argmax = greedy(logits).cpu() if all_greedy or greedy_rows is not None else None
    if argmax is not None:
        accept = argmax[at] == padded
    if probs is not None:
        p_draft = probs[at.to(device), padded.clamp(min=0).to(device)].cpu()
        u = _uniforms(num_drafts, k_max, generators)
        random_accept = u < p_draft
        accept = (
            random_accept
            if greedy_rows is None
            else torch.where(greedy_rows.cpu()[:, None], accept, random_accept)
        )
    accept &= valid
    # Accepted drafts: the leading run of accepts.
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    final_at = starts + num_accepted
    final = _final_tokens(
        final_at,
        num_accepted < num_drafts,
        padded,
        num_accepted,
        argmax,
        probs,
        greedy_rows,
        generators,
    )
    position_tokens = torch.zeros(logits.shape[0], dtype=torch.int64)
    if k_max:
        position_tokens[at[valid]] = padded[valid]
    position_tokens[final_at] = final
    tokens = padded.tolist()
    counts = num_accepted.tolist()
    finals = final.tolist()
    return Verified(
        [[*t[:a], f] for t, a, f in zip(tokens, counts, finals, strict=True)],
        counts,
        position_tokens.to(device),
    )


def _uniforms(
    num_drafts: torch.Tensor, k_max: int, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """[N, K] U(0, 1). A seeded row draws one per draft of its own from its
    generator, so its draws do not depend on its batch companions."""
    u = torch.rand((num_drafts.shape[0], k_max))
    for row, gen in generators.items():
        k = int(num_drafts[row])
        u[row, :k] = torch.rand(k, generator=gen, device=gen.device).cpu()
    return u


def _final_tokens(
    final_at: torch.Tensor,
    rejected: torch.Tensor,
    drafts: torch.Tensor,
    num_accepted: torch.Tensor,
    argmax: torch.Tensor | None,
    probs: torch.Tensor | None,
    greedy_rows: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """The token after each row's accepted drafts: the correction at a
    rejection, the bonus otherwise."""
    if probs is None:
        assert argmax is not None
        return argmax[final_at]
    device = probs.device
    picked = probs[final_at.to(device)]  # [N, V], a copy
    # A rejected draft leaves the residual: p without the draft token.
    rows = torch.nonzero(rejected).flatten()
    if rows.numel():
        rejected_tokens = drafts[rows, num_accepted[rows]]
        picked[rows.to(device), rejected_tokens.to(device)] = 0.0
    sampled = draw(picked, generators).cpu()
    if greedy_rows is None:
        return sampled
    assert argmax is not None
    return torch.where(greedy_rows.cpu(), argmax[final_at], sampled)
