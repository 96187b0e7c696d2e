"""Chi-square goodness of fit for the sampler's statistical tests (scipy is not a dependency),
and checks of the helper itself against tabulated critical values."""

from __future__ import annotations

import torch

# A correct sampler fails a fixed-seed test with probability 1e-4; a wrong one lands far
# beyond it.
ALPHA = 1e-4


def chi_square_p_value(statistic: float, df: int) -> float:
    """P(chi-square(df) >= statistic): the regularized upper incomplete gamma function."""
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(statistic / 2.0, dtype=torch.float64)))


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """(statistic, degrees of freedom) of observed counts against probabilities over the same
    bins; bins expecting fewer than `min_expected` draws are pooled into one."""
    counts = counts.double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    return statistic, len(exp) - 1


def fits(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """True unless the counts reject `probs` at level ALPHA."""
    statistic, df = chi_square(counts, probs)
    return chi_square_p_value(statistic, max(df, 1)) > ALPHA


def test_p_values_match_the_table():
    # Tabulated 0.999 quantiles of chi-square: df 1 -> 10.828, 5 -> 20.515, 20 -> 45.315.
    for df, quantile in ((1, 10.828), (5, 20.515), (20, 45.315)):
        assert abs(chi_square_p_value(quantile, df) - 1e-3) < 2e-5


def test_fits_accepts_the_right_distribution_and_rejects_a_wrong_one():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    generator = torch.Generator().manual_seed(0)
    draws = torch.multinomial(probs, 4000, replacement=True, generator=generator)
    counts = torch.bincount(draws, minlength=4)
    assert fits(counts, probs)
    assert not fits(counts, torch.tensor([0.45, 0.3, 0.15, 0.1]))
