"""Batched sampler: one call per step over the logits of the rows that sample.

First the logit adjustments that greedy rows get too (``logit_bias``, then
the repetition, frequency and presence penalties: engine/worker/penalties.py).
Greedy rows then take the argmax. Random rows are scaled by temperature,
optionally filtered by min-p, top-k and top-p (in that order, as vLLM v1
does), softmaxed, and drawn (kernels/sampling.py `draw`): on CPU by inverse
CDF, one uniform a row; on GPUs by the exponential race, ``argmax(probs /
q)`` with ``q ~ Exponential(1)``. Either picks token ``i`` with probability
``probs[i]``, and a seeded request draws from its own generator only, so its
tokens do not depend on its batch companions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import LogprobsLists
from engine.sampling_params import SamplingParams
from engine.worker.penalties import LogitBiasTensors, PenaltyTensors, TokenHistory
from kernels.sampling import draw, greedy

# Temperatures below this are treated as greedy: dividing by them would
# overflow float32 logits to inf, and the result is the argmax anyway.
_GREEDY_EPS = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_EPS


@dataclass
class SamplingTensors:
    """One step's sampling parameters, one row per sampling request.

    Built by ``from_params``; the tensors that a step does not need (all
    greedy, no top-k, no top-p, no min-p, no logit bias, no penalty) are
    None so the sampler can skip that work.
    Tensors are column vectors ``[N, 1]`` so they broadcast over the vocab.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    # [N] bool, True for greedy rows; None unless the batch mixes both kinds.
    greedy_mask: torch.Tensor | None
    # [N, 1] float32; greedy rows hold 1.0 (their sample is discarded).
    temperature: torch.Tensor | None
    # [N, 1] int64; 0 means "no top-k" for that row. None when no row uses it.
    top_k: torch.Tensor | None
    # Largest top-k of any row (bounds the torch.topk call); 0 when unused.
    max_top_k: int
    # [N, 1] float32; rows without top-p hold inf so float error in the
    # cumulative sum can never cut their tail. None when no row uses it.
    top_p: torch.Tensor | None
    # [N, 1] float32 log(min_p): a token is dropped when its (scaled) logit
    # is below the row's largest plus this; rows without min-p (and greedy
    # rows) hold -inf. None when no random row uses it.
    log_min_p: torch.Tensor | None
    # Applied before anything else, to greedy rows too; None when unused.
    logit_bias: LogitBiasTensors | None
    penalties: PenaltyTensors | None
    # Row index -> that request's own generator, for seeded random rows.
    generators: dict[int, torch.Generator]
    # Most top logprobs any row asked for; None when no row asked at all.
    max_num_logprobs: int | None

    @property
    def any_top_k(self) -> bool:
        return self.top_k is not None

    @property
    def any_top_p(self) -> bool:
        return self.top_p is not None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        history: TokenHistory | None = None,
    ) -> SamplingTensors:
        """Build from the sampling rows' params and generators (same order).

        ``generators[i]`` is the request's own generator (created once by the
        runner from its seed and kept across steps), or None to draw from
        the default generator. Generators of greedy rows are not touched.
        ``history`` holds the rows' tokens so far; it is read only for rows
        with a penalty, and required when there is one.
        """
        if len(params) != len(generators):
            raise ValueError(
                f"generators: expected one per row ({len(params)}), got {len(generators)}"
            )
        greedy = [is_greedy(p) for p in params]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        max_num_logprobs = max(requested) if requested else None
        logit_bias = penalties = None
        if any(p.adjusts_logits for p in params):
            logit_bias = LogitBiasTensors.build(params, device)
            penalties = _build_penalties(params, history, device)
        if all(greedy):
            return cls(
                num_rows=len(params),
                all_greedy=True,
                all_random=False,
                greedy_mask=None,
                temperature=None,
                top_k=None,
                max_top_k=0,
                top_p=None,
                log_min_p=None,
                logit_bias=logit_bias,
                penalties=penalties,
                generators={},
                max_num_logprobs=max_num_logprobs,
            )
        tensors = cls._build_random(params, generators, greedy, device, max_num_logprobs)
        tensors.logit_bias = logit_bias
        tensors.penalties = penalties
        return tensors

    @classmethod
    def _build_random(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        greedy: list[bool],
        device: torch.device | str,
        max_num_logprobs: int | None,
    ) -> SamplingTensors:
        all_random = not any(greedy)
        greedy_mask = None
        if not all_random:
            greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)]
        temperature = torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1)
        ks = [0 if g else p.top_k for p, g in zip(params, greedy, strict=True)]
        max_top_k = max(ks)
        top_k = None
        if max_top_k > 0:
            top_k = torch.tensor(ks, dtype=torch.int64, device=device).unsqueeze(1)
        ps = [
            math.inf if g or p.top_p >= 1.0 else p.top_p
            for p, g in zip(params, greedy, strict=True)
        ]
        top_p = None
        if any(p < 1.0 for p in ps):
            top_p = torch.tensor(ps, dtype=torch.float32, device=device).unsqueeze(1)
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        log_min_p = None
        if any(m > 0 for m in min_ps):
            logs = [math.log(m) if m > 0 else -math.inf for m in min_ps]
            log_min_p = torch.tensor(logs, dtype=torch.float32, device=device).unsqueeze(1)
        gens = {
            i: gen
            for i, (gen, g) in enumerate(zip(generators, greedy, strict=True))
            if gen is not None and not g
        }
        return cls(
            num_rows=len(params),
            all_greedy=False,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            log_min_p=log_min_p,
            logit_bias=None,  # set by from_params: greedy rows get them too
            penalties=None,
            generators=gens,
            max_num_logprobs=max_num_logprobs,
        )


def _build_penalties(
    params: Sequence[SamplingParams],
    history: TokenHistory | None,
    device: torch.device | str,
) -> PenaltyTensors | None:
    if history is None:
        if any(p.uses_penalties for p in params):
            raise ValueError("history: rows with a penalty need their tokens, got None")
        return None
    return PenaltyTensors.build(params, history, device)


@dataclass
class LogprobsTensors:
    """Logprobs of one step's sampled tokens, on the device.

    Column 0 is the sampled token, columns ``1..k`` the top-k tokens (k =
    the batch's ``max_num_logprobs``) in descending order.
    """

    logprob_token_ids: torch.Tensor  # [N, 1 + k] int64
    logprobs: torch.Tensor  # [N, 1 + k] float32
    sampled_token_ranks: torch.Tensor  # [N] int64, 1 = most likely

    def to_lists(self, num_logprobs_per_row: Sequence[int] | None = None) -> LogprobsLists:
        """Host lists, one row per sampled token, ``[sampled] + top[:n]``.

        ``num_logprobs_per_row[i]`` trims row ``i`` to the number of top
        logprobs its request asked for (0 keeps only the sampled token);
        None keeps every row at the batch maximum.
        """
        ids = self.logprob_token_ids.tolist()
        lps = self.logprobs.tolist()
        ranks = self.sampled_token_ranks.tolist()
        if num_logprobs_per_row is not None:
            ids, lps = _trim_rows(ids, lps, num_logprobs_per_row)
        return LogprobsLists(ids, lps, ranks)


def _trim_rows(
    ids: list[list[int]], lps: list[list[float]], num_per_row: Sequence[int]
) -> tuple[list[list[int]], list[list[float]]]:
    if len(num_per_row) != len(ids):
        raise ValueError(
            f"num_logprobs_per_row: expected one per row ({len(ids)}), got {len(num_per_row)}"
        )
    max_n = len(ids[0]) - 1 if ids else 0
    for n in num_per_row:
        if not 0 <= n <= max_n:
            raise ValueError(f"num_logprobs_per_row: {n} is outside [0, {max_n}]")
    return (
        [row[: 1 + n] for row, n in zip(ids, num_per_row, strict=True)],
        [row[: 1 + n] for row, n in zip(lps, num_per_row, strict=True)],
    )


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None


class Sampler:
    """Stateless; per-request state (generators) lives in ``SamplingTensors``."""

    def __call__(self, logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
        """Sample one token per row of ``logits`` ([N, vocab], float32).

        Logprobs, when any row asks, are the log-softmax of the *raw* logits
        (before logit bias, penalties, temperature, min-p, top-k and top-p):
        they describe the model's distribution, not the sampling transform.
        ``logits`` is never modified.
        """
        if logits.dim() != 2 or logits.shape[0] != tensors.num_rows:
            raise ValueError(
                f"logits: expected shape [{tensors.num_rows}, vocab], got {list(logits.shape)}"
            )
        sampled = self._sample(adjust_logits(logits, tensors), tensors)
        logprobs = None
        if tensors.max_num_logprobs is not None:
            logprobs = compute_logprobs(logits, sampled, tensors.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    def _sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        if t.all_greedy:
            return greedy(logits)
        random = draw(target_probs(logits, t), t.generators)
        if t.greedy_mask is None:
            return random
        return torch.where(t.greedy_mask, greedy(logits), random)


def target_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distribution random rows sample from: ``logits`` (already
    adjusted) scaled by temperature, filtered by min-p, top-k and top-p,
    softmaxed. Greedy rows come out at temperature 1 (callers ignore them)."""
    assert t.temperature is not None  # set whenever a row is random
    scaled = logits / t.temperature
    if t.log_min_p is not None:
        scaled = apply_min_p(scaled, t.log_min_p)
    if t.top_p is not None:
        scaled = _apply_top_k_top_p(scaled, t.top_k, t.top_p)
    elif t.top_k is not None:
        scaled = _apply_top_k(scaled, t.top_k, t.max_top_k)
    return scaled.softmax(dim=-1, dtype=torch.float32)


def adjust_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The logits every row (greedy too) chooses from: biased, then penalized."""
    if t.logit_bias is not None:
        logits = t.logit_bias.apply(logits)
    if t.penalties is not None:
        logits = t.penalties.apply(logits)
    return logits


def apply_min_p(logits: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with probability below min_p times the row's largest.

    In log space, ``p_i < min_p * p_max`` is ``logit_i < logit_max +
    log(min_p)``: no softmax needed. Rows holding -inf keep everything, and
    the most likely token always survives.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p
    return logits.masked_fill(logits < threshold, -math.inf)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Mask everything below each row's k-th largest logit to -inf.

    One ``topk(max_top_k)`` instead of a full sort. Ties with the k-th
    value are kept, so a row may keep slightly more than k tokens.
    """
    max_k = min(max_top_k, logits.shape[-1])
    top_values = logits.topk(max_k, dim=-1).values
    k = top_k.clamp(1, max_k)
    threshold = top_values.gather(1, k - 1)
    # Rows without top-k (k == 0) must keep everything.
    threshold = threshold.masked_fill(top_k == 0, -math.inf)
    return logits.masked_fill(logits < threshold, -math.inf)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then nucleus filtering on one descending sort.

    A token is kept when the probability mass strictly before it is below
    top_p: that is the smallest prefix whose mass reaches top_p, and the
    first token (mass before it 0 < top_p) is always kept.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        vocab = logits.shape[-1]
        # Cut below the k-th value rather than after position k, so ties
        # are kept exactly as in _apply_top_k and a row's result does not
        # depend on which path its batch took. k == 0 (off) keeps all.
        k = top_k.masked_fill(top_k == 0, vocab).clamp(max=vocab)
        kth_value = sorted_logits.gather(1, k - 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Logprobs of ``sampled`` and of the ``num_top`` most likely tokens.

    The rank counts tokens with a strictly greater logprob, plus one, so
    tied tokens share the better rank.
    """
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    sampled_ids = sampled.unsqueeze(1)
    sampled_lp = logprobs.gather(1, sampled_ids)
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    if num_top == 0:
        return LogprobsTensors(sampled_ids, sampled_lp, ranks)
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(
        torch.cat([sampled_ids, top_ids], dim=1), torch.cat([sampled_lp, top_lp], dim=1), ranks
    )
