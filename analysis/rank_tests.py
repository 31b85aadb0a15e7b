"""The interval that goes with Wilcoxon's signed-rank test: the Hodges–Lehmann shift (the median of the Walsh
averages ``(d_i + d_j) / 2``, i <= j) and the confidence interval obtained by inverting the test (Hollander,
Wolfe & Chicken, *Nonparametric Statistical Methods*, 3rd ed., §3.3).

The number of positive Walsh averages is the statistic W+, so with ``c`` the largest value whose two-sided
null probability ``2 P(W+ <= c)`` is below ``alpha``, the interval ``[A_(c+1), A_(N-c)]`` of the sorted Walsh
averages excludes 0 exactly when the test (scipy's exact two-sided p) rejects. Exact null distribution
without tied ranks up to ``exact_max`` differences; otherwise the normal approximation (tie-corrected), as
the test itself uses there.
"""

from __future__ import annotations

import math
from functools import cache
from statistics import NormalDist

import numpy as np
from scipy.stats import rankdata


@cache
def _null_cdf(n: int) -> np.ndarray:
    """``P(W+ <= t)`` for t = 0 .. n(n+1)/2 under the null (no ties): the coefficients of prod (1 + x^k) / 2^n."""
    counts = np.zeros(n * (n + 1) // 2 + 1, dtype=np.float64)
    counts[0] = 1.0
    for k in range(1, n + 1):
        counts[k:] = counts[k:] + counts[:-k].copy()
    return np.cumsum(counts) / 2.0**n


def _critical(d: np.ndarray, alpha: float, exact_max: int) -> int:
    """The largest c with a two-sided rejection at W+ <= c (-1: the test cannot reject at this n)."""
    n = len(d)
    absd = np.abs(d)
    if n <= exact_max and len(np.unique(absd)) == n:
        cdf = _null_cdf(n)
        below = np.nonzero(2 * cdf < alpha)[0]
        return int(below[-1]) if len(below) else -1
    ranks = rankdata(absd)
    _, tie_counts = np.unique(ranks, return_counts=True)
    var = n * (n + 1) * (2 * n + 1) / 24 - (tie_counts**3 - tie_counts).sum() / 48
    bound = n * (n + 1) / 4 - NormalDist().inv_cdf(1 - alpha / 2) * math.sqrt(var)
    return math.ceil(bound) - 1


def hodges_lehmann(d, level: float = 0.95, exact_max: int = 50) -> tuple[float, float, float]:
    """``(shift, lo, hi)`` of the differences ``d`` (zeros already dropped, as the test drops them); the
    bounds are infinite where no interval at ``level`` exists at this n. No differences: NaN."""
    d = np.asarray(d, dtype=float)
    n = len(d)
    if n == 0:
        return math.nan, math.nan, math.nan
    i, j = np.triu_indices(n)
    walsh = np.sort((d[i] + d[j]) / 2)
    c = _critical(d, 1 - level, exact_max)
    shift = float(np.median(walsh))
    if c < 0:
        return shift, -math.inf, math.inf
    return shift, float(walsh[c]), float(walsh[len(walsh) - 1 - c])
