"""The Hodges–Lehmann interval against scipy's signed-rank test and brute force (analysis/rank_tests.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.stats import wilcoxon

from kvleague.analysis.rank_tests import _null_cdf, hodges_lehmann


def test_the_interval_excludes_zero_exactly_when_scipys_exact_test_rejects():
    """400 random datasets, n 5..40, shifted and skewed (outliers included): the 95% interval excludes 0
    if and only if wilcoxon(method="exact") gives p < 0.05; and at every level the bounds are Walsh averages
    with 0 strictly inside when it does not reject."""
    rng = np.random.default_rng(46)
    disagreements = rejections = 0
    for _ in range(400):
        n = int(rng.integers(5, 41))
        d = rng.standard_t(3, n) * rng.uniform(0.1, 2) + rng.uniform(-1, 1)
        _, lo, hi = hodges_lehmann(d)
        rejects = wilcoxon(d, method="exact").pvalue < 0.05
        rejections += rejects
        disagreements += rejects != (lo > 0 or hi < 0)
    assert disagreements == 0 and 60 < rejections < 340  # both outcomes are exercised


def test_null_distribution_and_estimate_by_brute_force():
    for n in range(1, 9):  # every sign pattern: P(W+ <= t)
        sums = [sum(k for k, s in zip(range(1, n + 1), signs) if s) for signs in itertools.product((0, 1), repeat=n)]
        want = np.cumsum(np.bincount(sums, minlength=n * (n + 1) // 2 + 1)) / 2**n
        assert _null_cdf(n) == pytest.approx(want, abs=1e-15)
    d = [0.3, -0.1, 2.5, 0.05, 0.7]
    walsh = sorted((a + b) / 2 for i, a in enumerate(d) for b in d[i:])
    shift, lo, hi = hodges_lehmann(d)
    assert shift == pytest.approx(float(np.median(walsh)))
    assert (lo, hi) == (-math.inf, math.inf)  # n = 5: the smallest two-sided p is 0.0625, no 95% interval
    assert hodges_lehmann(d, level=0.9)[1:] == (walsh[0], walsh[-1])  # 2 P(W+ <= 0) = 0.0625 < 0.1
