"""The two ops that pick tokens from logits, shared by the sampler
(engine/worker/sampler.py) and the rejection sampler of speculative decoding
(engine/spec_decode/rejection.py): the per-row argmax, and a draw from each
row's probabilities."""

from __future__ import annotations

import torch

from kernels import cpu_kernels


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary, per row. For float32 CPU logits the
    compiled kernel (same ties and NaN rule as torch.argmax) spreads the rows
    over threads: torch's argmax took 4 ms of a batch-64 decode step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        module = cpu_kernels.load()
        if module is not None and logits.shape[-1] > 0:
            out: torch.Tensor = module.argmax_rows(logits)
            return out
    return logits.argmax(dim=-1)


def draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` ([N, V], non-negative; rows need not
    sum to 1), drawn with the row's probabilities; a zero is never drawn.

    Unseeded rows share the default generator; each seeded row draws from its
    own generator only, so its draws depend only on its seed and how many
    steps it has sampled. On CPU the compiled kernel draws by inverse CDF,
    one uniform a row (`uniforms`); elsewhere (or without the kernels) the
    exponential race draws one exponential per token, which is what GPUs do
    fast and CPUs do not (torch's exponential_ took 63 ms of a 64-row decode
    step of the default model; the kernel takes well under 1).
    """
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.stride(-1) == 1:
        module = cpu_kernels.load()
        if module is not None and probs.shape[-1] > 0:
            out: torch.Tensor = module.sample_rows(probs, uniforms(probs.shape[0], generators))
            return out
    return exponential_race(probs, generators)


def uniforms(rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """float64 [rows] in [0, 1): the default generator's, then each seeded
    row's own generator's in its place."""
    u = (
        torch.rand(rows, dtype=torch.float64)
        if len(generators) < rows
        else torch.empty(rows, dtype=torch.float64)
    )
    for row, gen in generators.items():
        u[row] = torch.rand((), dtype=torch.float64, generator=gen)
    return u


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``argmax(probs / q)``, ``q ~ Exponential(1)`` per element: a sample,
    with `draw`'s rule for generators (a seeded row draws its whole row)."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # exponential_ may return exactly 0; 0/0 would be NaN, which argmax
    # treats as the maximum and would pick a filtered-out token.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)
