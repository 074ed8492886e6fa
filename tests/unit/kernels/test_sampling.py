"""kernels/sampling.py: the compiled inverse-CDF draw against a float64
reference, its edges (zero weights, exact boundaries, rows without mass),
and both draws' empirical distributions and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels, sampling


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("no C++ toolchain here: the exponential race is used instead")
    return module


def _reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose float64 running sum exceeds u * total."""
    cum = probs.double().cumsum(-1)
    target = (u * cum[:, -1]).unsqueeze(1).contiguous()
    return torch.searchsorted(cum, target, right=True).squeeze(1)


@pytest.mark.parametrize("vocab", [1, 7, 511, 512, 513, 5000])
def test_draws_equal_the_float64_inverse_cdf(kernel, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=g) * 3  # rows need not sum to 1
    probs[probs < 0.9] = 0.0  # many zeros, as top-k / top-p leave
    probs[:, 0] += 0.01  # every row keeps some mass
    u = torch.rand(64, dtype=torch.float64, generator=g)
    got = kernel.sample_rows(probs, u)
    assert torch.equal(got, _reference(probs, u))
    assert bool((probs[torch.arange(64), got] > 0).all())


def test_exact_boundaries_and_extreme_uniforms_never_draw_a_zero(kernel) -> None:
    row = torch.tensor([0.25, 0.0, 0.25, 0.0, 0.5, 0.0])
    cases = {0.0: 0, 0.25: 2, 0.5: 4, 0.75: 4, 1.0 - 2.0**-53: 4}
    probs = row.expand(len(cases), -1).contiguous()
    u = torch.tensor(list(cases), dtype=torch.float64)
    assert kernel.sample_rows(probs, u).tolist() == list(cases.values())


def test_rows_without_mass_take_the_argmax(kernel) -> None:
    probs = torch.tensor([[0.0, 0.0, 0.0], [0.1, float("nan"), 0.2], [0.0, 3.0, float("inf")]])
    got = kernel.sample_rows(probs, torch.full((3,), 0.5, dtype=torch.float64))
    assert got.tolist() == [0, 1, 2]


def test_bad_inputs_are_named(kernel) -> None:
    with pytest.raises(RuntimeError, match="uniforms"):
        kernel.sample_rows(torch.ones(2, 4), torch.ones(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="probs"):
        kernel.sample_rows(
            torch.ones(2, 4, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
        )


@pytest.mark.parametrize("way", ["draw", "exponential_race"])
def test_empirical_distribution(way: str) -> None:
    weights = torch.tensor([4.0, 0.0, 2.0, 1.0, 1.0])
    expected = weights / weights.sum()
    n = 40_000
    torch.manual_seed(5)
    fn = sampling.draw if way == "draw" else sampling.exponential_race
    counts = torch.bincount(fn(weights.expand(n, -1).contiguous(), {}), minlength=5).double()
    assert counts[1] == 0
    keep = expected > 0
    stat = float(((counts[keep] - n * expected[keep]) ** 2 / (n * expected[keep])).sum())
    assert stat < 16.27, counts  # chi-square, 3 degrees of freedom, 99.9th percentile


def test_seeded_rows_do_not_depend_on_their_companions() -> None:
    probs = torch.rand(1, 300, generator=torch.Generator().manual_seed(0))

    def run(companions: int) -> list[int]:
        gen = torch.Generator().manual_seed(11)
        rows = torch.cat([probs, torch.rand(companions, 300)])
        return [int(sampling.draw(rows.clone(), {0: gen})[0]) for _ in range(20)]

    assert run(0) == run(5) == run(63)
