"""Adaptive drafting: per request, only the drafts that pay for themselves.

Verifying a draft costs a token row in the next forward. On a GPU a few
more rows are nearly free; on a CPU a forward is compute-bound from a few
rows on, so a row costs close to what a decode token costs, and a draft
that is rejected makes the step slower than a plain decode. So each
request's drafts are capped by what they are expected to yield:

- Acceptance: per request and draft position j, the rate at which its
  draft j matched given that the ones before it did, estimated from what
  the request's own tokens did to its earlier drafts (decayed counts, so the
  estimate follows the text: a request that starts copying is noticed
  within a few steps); their running product is the probability that the
  first j drafts are all accepted, draft j's expected gain. The drafts
  observed are the proposer's, whether or not they were sent: a request
  whose drafts are off is probed (its drafts proposed, observed, not sent)
  every ``CHEAP_PROBE_INTERVAL`` steps with n-gram lookup, every
  ``PROBE_INTERVAL`` with a draft model, so it turns them back on when its
  text becomes copy-heavy. Comparing a draft with the token the target then produced measures
  acceptance exactly for greedy requests, and in distribution for sampled
  ones (the target samples the draft token with the probability with which
  verification accepts it).
- Cost: a step of R token rows costs ``cost(R)`` seconds, measured on this
  machine at start-up (``measure_step_cost``), plus, with an expensive
  proposer, its own time per drafted position (timed as it runs).
- Choice: the step's drafts maximise expected tokens per second; sorted by
  gain, the best set is a prefix (``plan_drafts``). A batch's rows are dear when it is large (a
  CPU's forward grows with its rows), so the same rule turns drafts off at a
  large batch unless they are almost surely accepted; ``disable_by_batch_size``
  (vLLM's key) is a hard limit on top.

Drafts only ever change speed: the target verifies every one, so outputs do
not depend on this policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from engine.spec_decode.proposer import ProposeInputs, Proposer
from kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.worker.input_batch import InputBatch
    from engine.worker.model_runner import CausalLM

# Steps a request goes without drafts before it is probed again (one
# proposal, observed but not sent): n-gram lookup costs ~5% of a decode step
# on a CPU, too much to pay every step for nothing; a draft model's is a
# forward per draft.
CHEAP_PROBE_INTERVAL = 2
PROBE_INTERVAL = 32
# Each observation's weight against the past: about the last 1 / (1 - DECAY)
# verifications count.
DECAY = 0.85
# Drafts per step at most (SpeculativeConfig's num_speculative_tokens).
MAX_DRAFTS = 16
# Pseudo-counts per draft position of a new request: the first draft is a
# coin flip until observed; a later one is likely accepted once the ones
# before it were (copying goes on: measured 0.83-1.0 on copy-heavy text).
PRIOR_ACCEPTED = np.array([1.0] + [4.0] * (MAX_DRAFTS - 1))
PRIOR_REJECTED = np.ones(MAX_DRAFTS)
# Drafts must beat a plain step by this factor in expected tokens per second:
# acceptance estimates are noisy.
MARGIN = 1.03
# Seconds a verifying step spends beyond a sampling one outside the forward
# (per-position sampling tensors, rejection; measured ~0.55 ms on the
# development CPU at one request).
VERIFY_OVERHEAD = 0.6e-3


@dataclass(frozen=True)
class StepCost:
    """Seconds of a decode step of ``rows`` token rows (forward and
    logits), linear between the measured points and beyond the last two."""

    rows: npt.NDArray[np.float64]
    seconds: npt.NDArray[np.float64]

    def __post_init__(self) -> None:
        if self.rows.size < 2 or np.any(np.diff(self.rows) <= 0):
            raise ValueError("StepCost needs at least two increasing row counts")

    def __call__(self, rows: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        inside: npt.NDArray[np.float64] = np.interp(rows, self.rows, self.seconds)
        # Past the last point a forward is compute-bound: linear in its rows.
        slope = (self.seconds[-1] - self.seconds[-2]) / (self.rows[-1] - self.rows[-2])
        beyond = self.seconds[-1] + slope * (rows - self.rows[-1])
        return np.where(rows > self.rows[-1], beyond, inside)


def row_grid(max_rows: int) -> list[int]:
    """Row counts to measure: dense where kernels change shape (few rows),
    sparse further on, up to ``max_rows`` (at least two points)."""
    grid = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    return [r for r in grid if r <= max(2, max_rows)]


@torch.inference_mode()
def measure_step_cost(
    model: CausalLM,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    max_rows: int,
    repeats: int = 3,
) -> StepCost:
    """Times decode forwards (and their logits) of each ``row_grid`` count
    over the null block (which no request reads; zeroed afterwards), the
    fastest of ``repeats`` rounds. Short contexts: attention's share, a small
    one at these lengths, is left out."""
    grid = row_grid(max_rows)
    _decode_forward(model, kv_caches, device, grid[-1])  # first use: kernels load
    seconds = np.full(len(grid), np.inf)
    # Rounds over the whole grid, not repeats of one count: a burst of
    # outside load then spoils one round's points, and the fastest is kept.
    for _ in range(repeats):
        for i, rows in enumerate(grid):
            start = time.perf_counter()
            _decode_forward(model, kv_caches, device, rows)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[i] = min(seconds[i], time.perf_counter() - start)
    for cache in kv_caches:
        cache[:, 0].zero_()
    # More rows never cost less: a point above a later one was noise.
    monotone = np.minimum.accumulate(seconds[::-1])[::-1]
    return StepCost(np.array(grid, np.float64), monotone)


def _decode_forward(
    model: CausalLM, kv_caches: list[torch.Tensor], device: torch.device, rows: int
) -> None:
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(rows, dtype=torch.int32, device=device),
        block_table=torch.zeros((rows, 1), dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=1,
        decode_only=True,
    )
    ids = torch.zeros(rows, dtype=torch.int64, device=device)
    hidden = model(ids, torch.zeros(rows, dtype=torch.int64, device=device), kv_caches, meta)
    model.compute_logits(hidden)


@dataclass
class Acceptance:
    """One request's draft record: per draft position, decayed counts of
    drafts matched and mismatched there (given all before it matched), and
    its latest proposal, awaiting the tokens that follow."""

    accepted: npt.NDArray[np.float64] = field(default_factory=lambda: PRIOR_ACCEPTED.copy())
    rejected: npt.NDArray[np.float64] = field(default_factory=lambda: PRIOR_REJECTED.copy())
    pending: list[int] = field(default_factory=list)
    pending_at: int = 0  # the request's token count when they were proposed
    idle_steps: int = 0  # steps since its drafts were last proposed

    def gains(self) -> npt.NDArray[np.float64]:
        """[MAX_DRAFTS]: the probability that the first j + 1 drafts are all
        accepted (copying is bursty: a run that started tends to go on, so
        each position has its own conditional rate)."""
        rates = self.accepted / (self.accepted + self.rejected)
        return np.cumprod(rates).astype(np.float64)

    def observe(self, new_tokens: list[int]) -> None:
        """The tokens that followed the pending drafts so far. The drafts
        are scored once a mismatch shows or all of them are seen (a step
        yields as many tokens as it verified drafts, plus one: deep drafts
        are scored over later steps, sent or not)."""
        drafts = self.pending
        seen = min(len(drafts), len(new_tokens))
        matched = 0
        while matched < seen and drafts[matched] == new_tokens[matched]:
            matched += 1
        if matched == seen < len(drafts):
            return  # all matched so far: wait for the rest
        self.pending = []
        told = min(matched + 1, len(drafts))
        self.accepted[:told] *= DECAY
        self.rejected[:told] *= DECAY
        self.accepted[:matched] += 1.0
        if matched < len(drafts):
            self.rejected[matched] += 1.0


def plan_drafts(
    gains: npt.NDArray[np.float64],
    available: npt.NDArray[np.int64],
    cost: StepCost,
    propose_seconds: float = 0.0,
) -> npt.NDArray[np.int64]:
    """How many drafts each of a step's requests should send.

    ``gains[i, j]``: the probability that request i's first j + 1 drafts
    are all accepted (non-increasing in j); ``available[i]``: drafts it may
    send. A step of ``n`` requests and ``m`` drafts yields ``n`` tokens plus
    the gains of the drafts it sends, in ``cost(n + m)`` seconds, plus
    ``VERIFY_OVERHEAD``, plus ``propose_seconds`` per drafted position (the
    longest request's count) for an expensive proposer. The ratio is maximised over
    the prefixes of the drafts sorted by gain (a request's gains fall with
    j, so each request's chosen drafts are a prefix of its own); the best
    must beat the plain step by ``MARGIN``, else none are sent.
    """
    n = available.size
    caps = np.zeros(n, np.int64)
    total = int(available.sum())
    if n == 0 or total == 0:
        return caps
    owner = np.repeat(np.arange(n), available)
    depth = np.arange(total) - np.repeat(np.cumsum(available) - available, available) + 1
    gain = gains[owner, depth - 1]
    order = np.lexsort((depth, -gain))
    tokens = n + np.cumsum(gain[order])
    seconds = cost(np.arange(n + 1, n + total + 1, dtype=np.float64))
    seconds = seconds + VERIFY_OVERHEAD + propose_seconds * np.maximum.accumulate(depth[order])
    plain = n / float(cost(np.array([float(n)]))[0])
    rates = tokens / seconds
    best = int(np.argmax(rates))
    if rates[best] < plain * MARGIN:
        return caps
    np.add.at(caps, owner[order[: best + 1]], 1)
    return caps


@dataclass
class AdaptiveProposer:
    """Wraps a proposer; sends each request only the drafts that pay."""

    inner: Proposer
    cost: StepCost
    # A cheap proposer (n-gram lookup) costs nothing per drafted position
    # and probes more often.
    cheap: bool
    disable_by_batch_size: int | None = None
    requests: dict[str, Acceptance] = field(default_factory=dict)
    # An expensive proposer's seconds per drafted position (decayed mean).
    propose_seconds: float = 0.0

    def reset(self, req_id: str, num_valid: int) -> None:
        # A resumed request keeps its acceptance; its proposal is stale.
        record = self.requests.get(req_id)
        if record is not None:
            record.pending = []
        self.inner.reset(req_id, num_valid)

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.inner.remove(req_id)

    def propose(self, inputs: ProposeInputs) -> list[list[int]]:
        batch = inputs.batch
        req_ids = [batch.req_ids[r] for r in inputs.rows.tolist()]
        records = [self.requests.setdefault(rid, Acceptance()) for rid in req_ids]
        _observe(records, batch, inputs.rows)
        gains = np.array([r.gains() for r in records], np.float64).reshape(-1, MAX_DRAFTS)
        allowed = self._allowed(inputs, gains)
        asked = self._asked(records, inputs.max_drafts, allowed)
        drafts = self._inner_propose(replace(inputs, max_drafts=asked))
        ends = batch.num_tokens[inputs.rows].tolist()
        for record, row_drafts, end in zip(records, drafts, ends, strict=True):
            if row_drafts and not record.pending:
                record.pending, record.pending_at = list(row_drafts), int(end)
        available = np.minimum([len(d) for d in drafts], allowed).astype(np.int64)
        caps = self._plan(gains, available, inputs.rows.size, batch)
        probed = (asked > 0) & (allowed == 0)
        for record, cap, probe in zip(records, caps.tolist(), probed.tolist(), strict=True):
            record.idle_steps = 0 if cap or probe else record.idle_steps + 1
        return [d[:cap] for d, cap in zip(drafts, caps.tolist(), strict=True)]

    def _allowed(
        self, inputs: ProposeInputs, gains: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.int64]:
        """Drafts each request may send, before the proposer says how many
        it has: the plan as if every request had all of its drafts."""
        return self._plan(gains, inputs.max_drafts, inputs.rows.size, inputs.batch)

    def _plan(
        self,
        gains: npt.NDArray[np.float64],
        available: npt.NDArray[np.int64],
        num_rows: int,
        batch: InputBatch,
    ) -> npt.NDArray[np.int64]:
        limit = self.disable_by_batch_size
        if limit is not None and batch.num_reqs >= limit:
            return np.zeros(num_rows, np.int64)
        extra = 0.0 if self.cheap else self.propose_seconds
        return plan_drafts(gains, available, self.cost, extra)

    def _asked(
        self,
        records: list[Acceptance],
        max_drafts: npt.NDArray[np.int64],
        allowed: npt.NDArray[np.int64],
    ) -> npt.NDArray[np.int64]:
        """What the inner proposer is asked for: all drafts for a request
        due for a probe, and, from a cheap one, for every request with any
        allowed (the ones not sent are scored too); else the allowed ones."""
        interval = CHEAP_PROBE_INTERVAL if self.cheap else PROBE_INTERVAL
        due = np.array([r.idle_steps >= interval for r in records], bool)
        if self.cheap:
            due |= allowed > 0
        return np.where(due, max_drafts, allowed)

    def _inner_propose(self, inputs: ProposeInputs) -> list[list[int]]:
        if not inputs.max_drafts.any():
            return [[] for _ in range(inputs.rows.size)]
        start = time.perf_counter()
        drafts = self.inner.propose(inputs)
        positions = int(inputs.max_drafts.max(initial=0))
        if not self.cheap and positions:
            per = (time.perf_counter() - start) / positions
            self.propose_seconds = (
                per
                if not self.propose_seconds
                else (DECAY * self.propose_seconds + (1 - DECAY) * per)
            )
        return drafts


def _observe(records: list[Acceptance], batch: InputBatch, rows: npt.NDArray[np.int64]) -> None:
    """Each request's pending drafts against the tokens it has now."""
    ends = batch.num_tokens[rows].tolist()
    for record, row, end in zip(records, rows.tolist(), ends, strict=True):
        if not record.pending:
            continue
        if end <= record.pending_at:  # nothing new yet, or rewound (preempted)
            if end < record.pending_at:
                record.pending = []
            continue
        record.observe(batch.token_ids[row, record.pending_at : end].tolist())
