"""dashboard.stats against scipy / statsmodels and hand-computed values on fixed inputs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dashboard import stats

sm_proportion = pytest.importorskip("statsmodels.stats.proportion")
sm_tables = pytest.importorskip("statsmodels.stats.contingency_tables")
scipy_stats = pytest.importorskip("scipy.stats")


# ---------------------------------------------------------------------------------------------- Wilson


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (10, 10), (17, 30), (0, 1), (1, 1), (372, 500), (3, 1000)])
def test_wilson_matches_statsmodels(k, n):
    lo, hi = stats.wilson_interval(k, n)
    ref_lo, ref_hi = sm_proportion.proportion_confint(k, n, alpha=0.05, method="wilson")
    assert lo == pytest.approx(ref_lo, abs=1e-12)
    assert hi == pytest.approx(ref_hi, abs=1e-12)


def test_wilson_hand_computed():
    z2 = 1.959963984540054**2
    # k = 0: the interval is [0, z^2 / (n + z^2)]
    lo, hi = stats.wilson_interval(0, 10)
    assert lo == 0.0
    assert hi == pytest.approx(z2 / (10 + z2), abs=1e-12)  # 0.27753...
    assert hi == pytest.approx(0.2775, abs=1e-4)
    # k = n / 2: symmetric about 1/2
    lo, hi = stats.wilson_interval(15, 30)
    assert lo + hi == pytest.approx(1.0, abs=1e-12)
    # an AIME-sized run: 10 of 30 right is 33% with roughly +/-17 points
    lo, hi = stats.wilson_interval(10, 30)
    assert (lo, hi) == pytest.approx((0.1923, 0.5122), abs=1e-4)


def test_wilson_edges():
    assert all(math.isnan(x) for x in stats.wilson_interval(0, 0))
    with pytest.raises(ValueError):
        stats.wilson_interval(3, 2)
    assert stats.z_value(0.95) == pytest.approx(1.959963984540054, abs=1e-12)


# ---------------------------------------------------------------------------------------------- McNemar


@pytest.mark.parametrize("b,c", [(0, 0), (0, 5), (5, 0), (3, 3), (1, 9), (12, 4), (40, 25), (200, 160), (0, 1)])
def test_mcnemar_exact_matches_statsmodels_and_scipy(b, c):
    got = stats.mcnemar(b, c, exact=True)
    ref = sm_tables.mcnemar(np.array([[7, b], [c, 11]]), exact=True)
    assert got.pvalue == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-15)
    if b + c:
        assert got.pvalue == pytest.approx(scipy_stats.binomtest(min(b, c), b + c, 0.5).pvalue, rel=1e-9)


@pytest.mark.parametrize("b,c", [(0, 5), (5, 0), (1, 9), (12, 4), (40, 25), (200, 160), (2, 3)])
def test_mcnemar_chi2_continuity_matches_statsmodels(b, c):
    got = stats.mcnemar(b, c, exact=False)
    ref = sm_tables.mcnemar(np.array([[7, b], [c, 11]]), exact=False, correction=True)
    assert got.statistic == pytest.approx(ref.statistic, rel=1e-12)
    assert got.pvalue == pytest.approx(ref.pvalue, rel=1e-9)


def test_mcnemar_hand_computed():
    # b = 0, c = 5: P = 2 * (1/2)^5 = 0.0625 (exact); chi-square (5 - 1)^2 / 5 = 3.2
    assert stats.mcnemar(0, 5).pvalue == pytest.approx(0.0625, abs=1e-15)
    chi = stats.mcnemar(0, 5, exact=False)
    assert chi.statistic == pytest.approx(3.2)
    assert chi.pvalue == pytest.approx(math.erfc(math.sqrt(1.6)))
    assert stats.mcnemar(0, 0).pvalue == 1.0
    # b == c: no evidence either way; the corrected statistic is 0, not statsmodels' 1 / (b + c)
    tie = stats.mcnemar(3, 3, exact=False)
    assert (tie.statistic, tie.pvalue) == (0.0, 1.0)
    # large counts stay finite and exact (log-space binomial)
    assert 0 < stats.mcnemar(2000, 2200).pvalue < 0.05


# ---------------------------------------------------------------------------------------------- bootstrap


def _exact_bootstrap_cdf(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The exact bootstrap distribution of the mean: enumerate the multinomial over the distinct values."""
    n = int(counts.sum())
    probs = counts / n
    means, weights = [], []
    k = len(values)
    for combo in itertools.product(range(n + 1), repeat=k - 1):
        if sum(combo) > n:
            continue
        draw = (*combo, n - sum(combo))
        w = math.factorial(n)
        for x, p in zip(draw, probs):
            w = w / math.factorial(x) * p**x
        means.append(float(np.dot(draw, values)) / n)
        weights.append(w)
    order = np.argsort(means)
    return np.array(means)[order], np.cumsum(np.array(weights)[order])


def test_bootstrap_interval_hand_computed_binomial():
    # problems [0, 0, 1, 1, 1]: the bootstrap mean is Binomial(5, 0.6) / 5. P[X <= 0] = 0.01024 < 0.025
    # < P[X <= 1] = 0.08704, and P[X <= 4] = 0.92224 < 0.975: the percentile interval is [0.2, 1.0].
    lo, hi = stats.bootstrap_interval([0, 0, 1, 1, 1], n_boot=20000, seed=1)
    assert (lo, hi) == (0.2, 1.0)


def test_bootstrap_interval_matches_scipy():
    rng = np.random.default_rng(7)
    per_problem = rng.integers(0, 5, size=60) / 4  # 4 samples per problem: shares 0, .25, ..., 1
    lo, hi = stats.bootstrap_interval(per_problem, n_boot=20000, seed=3)
    ref = scipy_stats.bootstrap((per_problem,), np.mean, n_resamples=20000, method="percentile", random_state=5)
    assert lo == pytest.approx(ref.confidence_interval.low, abs=0.01)
    assert hi == pytest.approx(ref.confidence_interval.high, abs=0.01)


def test_bootstrap_multinomial_equals_index_resampling_exactly_in_distribution():
    values = np.array([0.0, 0.5, 1.0])
    counts = np.array([2, 3, 3])
    means, cdf = _exact_bootstrap_cdf(values, counts)
    draws = stats.bootstrap_means(values, counts, n_boot=40000, seed=11)
    for q in (0.025, 0.25, 0.5, 0.75, 0.975):
        exact = means[np.searchsorted(cdf, q - 1e-12)]
        got = np.quantile(draws, q, method="inverted_cdf")
        assert abs(got - exact) <= 1 / 16 + 1e-12  # within one step of the lattice of means (1/(2n))


def test_bootstrap_degenerate():
    assert stats.bootstrap_interval([1, 1, 1, 1]) == (1.0, 1.0)
    assert all(math.isnan(x) for x in stats.bootstrap_interval([]))
    # the histogram form and the list form agree draw for draw
    assert stats.bootstrap_interval([0.0, 1.0], counts=[3, 7], seed=2) == stats.bootstrap_interval([0, 0, 0] + [1] * 7, seed=2)


def test_paired_bootstrap_pvalue_matches_exact_enumeration():
    diffs = np.array([-1.0, 0.0, 1.0])
    counts = np.array([2, 12, 7])
    means, cdf = _exact_bootstrap_cdf(diffs, counts)
    p_le0 = float(cdf[np.searchsorted(means, 0.0, side="right") - 1])
    p_ge0 = 1.0 - float(cdf[np.searchsorted(means, 0.0, side="left") - 1])
    exact_p = min(1.0, 2 * min(p_le0, p_ge0))
    got = stats.paired_bootstrap(diffs, counts, n_boot=40000, seed=4)
    assert got.mean == pytest.approx(5 / 21)
    assert got.n == 21
    assert got.pvalue == pytest.approx(exact_p, abs=0.006)
    expanded = np.repeat(diffs, counts)
    ref = scipy_stats.bootstrap((expanded,), np.mean, n_resamples=40000, method="percentile", random_state=9)
    assert got.lo == pytest.approx(ref.confidence_interval.low, abs=1 / 21 + 1e-9)
    assert got.hi == pytest.approx(ref.confidence_interval.high, abs=1 / 21 + 1e-9)


def test_paired_bootstrap_no_difference():
    got = stats.paired_bootstrap([0.0] * 30)
    assert (got.mean, got.lo, got.hi, got.pvalue) == (0.0, 0.0, 0.0, 1.0)


# ---------------------------------------------------------------------------------------------- choices


def test_accuracy_interval_wilson_for_single_samples_bootstrap_otherwise():
    single = stats.accuracy_interval([(1, 1, 12), (0, 1, 18)])
    assert single.method == "Wilson"
    assert single.mean == pytest.approx(0.4)
    assert (single.lo, single.hi) == pytest.approx(sm_proportion.proportion_confint(12, 30, method="wilson"), abs=1e-12)
    multi = stats.accuracy_interval([(3, 4, 10), (1, 4, 10), (4, 4, 5)])
    assert multi.method == "bootstrap"
    assert multi.problems == 25 and multi.samples == 100
    assert multi.mean == pytest.approx((0.75 * 10 + 0.25 * 10 + 5) / 25)
    per_problem = np.repeat([0.75, 0.25, 1.0], [10, 10, 5])
    ref = scipy_stats.bootstrap((per_problem,), np.mean, n_resamples=20000, method="percentile", random_state=0)
    assert multi.lo == pytest.approx(ref.confidence_interval.low, abs=0.02)
    assert multi.hi == pytest.approx(ref.confidence_interval.high, abs=0.02)


def test_compare_paired_uses_mcnemar_for_greedy():
    # (k_a, m_a, k_b, m_b, problems): 9 method-right/reference-wrong, 2 the reverse, 30 agree
    pairs = [(1, 1, 0, 1, 9), (0, 1, 1, 1, 2), (1, 1, 1, 1, 20), (0, 1, 0, 1, 10)]
    c = stats.compare_paired(pairs)
    assert c.test == "McNemar (exact)"
    assert (c.b, c.c, c.n) == (9, 2, 41)
    assert c.diff == pytest.approx(7 / 41)
    assert c.pvalue == pytest.approx(sm_tables.mcnemar(np.array([[20, 9], [2, 10]]), exact=True).pvalue)
    assert c.lo <= c.diff <= c.hi


def test_compare_paired_uses_bootstrap_for_several_samples():
    pairs = [(2, 4, 1, 4, 6), (4, 4, 4, 4, 10), (0, 4, 1, 4, 3)]
    c = stats.compare_paired(pairs, n_boot=4000)
    assert c.test == "paired bootstrap"
    assert c.diff == pytest.approx((6 * 0.25 + 3 * -0.25) / 19)
    assert 0 < c.pvalue <= 1


def test_verdicts():
    better = stats.Comparison(0.1, 0.04, 0.16, 0.001, "t", 100)
    worse = stats.Comparison(-0.1, -0.16, -0.04, 0.001, "t", 100)
    unclear = stats.Comparison(0.02, -0.03, 0.07, 0.4, "t", 100)
    assert stats.verdict_superior(better) == "replicates"
    assert stats.verdict_superior(worse) == "does not replicate"
    assert stats.verdict_superior(unclear) == "inconclusive"
    assert stats.verdict_superior(stats.Comparison(math.nan, math.nan, math.nan, math.nan, "none", 0)) == "not measured yet"
    assert stats.verdict_noninferior(unclear, 0.05) == "replicates"
    assert stats.verdict_noninferior(worse, 0.05) == "inconclusive"
    assert stats.verdict_noninferior(stats.Comparison(-0.2, -0.26, -0.14, 0.0, "t", 100), 0.05) == "does not replicate"


def test_pareto_front():
    pts = [(1, 50), (2, 60), (2, 55), (3, 58), (4, 70), (5, 70)]
    assert stats.pareto_front(pts) == [True, True, False, False, True, False]
