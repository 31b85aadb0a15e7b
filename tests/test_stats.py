"""analysis.stats, score_tests, multiplicity against statsmodels / scipy, numeric
maximum likelihood and brute-force enumeration."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from kvleague.analysis import common_set, multiplicity, score_tests, stats
from kvleague.analysis.queries import QUESTION_CELL_COLUMNS

sm_proportion = pytest.importorskip("statsmodels.stats.proportion")
sm_tables = pytest.importorskip("statsmodels.stats.contingency_tables")
sm_multitest = pytest.importorskip("statsmodels.stats.multitest")
scipy_stats = pytest.importorskip("scipy.stats")
scipy_optimize = pytest.importorskip("scipy.optimize")

Z = scipy_stats.norm.ppf(0.975)


def greedy_pairs(b: int, c: int, n: int) -> list[tuple[int, int, int, int, int]]:
    """(k_a, m_a, k_b, m_b, count): b method-right/reference-wrong, c the reverse, the rest concordant."""
    return [(1, 1, 0, 1, b), (0, 1, 1, 1, c), (1, 1, 1, 1, n - b - c)]


def tango(b: int, c: int, n: int) -> stats.Comparison:
    """Tango's score test and interval on b / c discordant of n greedy questions, whatever b + c."""
    values = [Fraction(1)] * b + [Fraction(-1)] * c + [Fraction(0)] * (n - b - c)
    return stats.comparison_from(stats.unweighted(values, 1).effective())


def tango_z_numeric(b: float, c: float, n: float, delta: float) -> float:
    """Tango's statistic from its definition: restricted MLE of p21 (p12 = p21 + delta) by numeric
    maximisation of the multinomial likelihood, z = (b - c - n delta) / sqrt(n (p12 + p21 - delta^2))."""
    lo, hi = max(0.0, -delta) + 1e-13, (1 - delta) / 2 - 1e-13

    def nll(p21):
        p12 = p21 + delta
        terms = [(b, p12), (c, p21), (n - b - c, 1 - p12 - p21)]
        return -sum(k * math.log(p) for k, p in terms if k)

    p21 = scipy_optimize.minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-14}).x
    return (b - c - n * delta) / math.sqrt(n * (2 * p21 + delta - delta**2))


# ---------------------------------------------------------------------------------------------- Wilson


def wilson(k: int, n: int) -> tuple[float, float]:
    acc = stats.accuracy_interval([(1, 1, k), (0, 1, n - k)])
    return acc.lo, acc.hi


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (10, 10), (17, 30), (0, 1), (1, 1), (372, 500), (3, 1000)])
def test_wilson_matches_statsmodels(k, n):
    lo, hi = wilson(k, n)
    ref_lo, ref_hi = sm_proportion.proportion_confint(k, n, alpha=0.05, method="wilson")
    assert lo == pytest.approx(ref_lo, abs=1e-12)
    assert hi == pytest.approx(ref_hi, abs=1e-12)
    assert stats.accuracy_interval([(1, 1, k), (0, 1, n - k)]).method == "Wilson"


def test_wilson_edges():
    assert all(math.isnan(x) for x in wilson(0, 0))
    with pytest.raises(ValueError):
        score_tests.critical_z(1.0)
    assert score_tests.critical_z(0.95) == pytest.approx(1.959963984540054, abs=1e-12)
    assert wilson(10, 30) == pytest.approx((0.1923, 0.5122), abs=1e-4)


def test_wilson_test_is_dual_to_the_interval():
    """p0 inside the interval exactly when the score test does not reject (every k of n = 30, fine p0 grid)."""
    n = 30
    for k in range(n + 1):
        lo, hi = wilson(k, n)
        for p0 in np.linspace(0.005, 0.995, 199):
            p = 2 * scipy_stats.norm.sf(abs(score_tests.wilson_z(k / n, n, p0)))
            if min(abs(p0 - lo), abs(p0 - hi)) > 1e-9:
                assert (lo <= p0 <= hi) == (p >= 0.05), (k, p0)


# ---------------------------------------------------------------------------------------------- Tango


@pytest.mark.parametrize(
    "b,c,n", [(0, 5, 100), (5, 0, 100), (3, 3, 20), (9, 2, 31), (12, 4, 50), (40, 25, 300), (1, 0, 1)]
)
def test_tango_at_zero_is_mcnemar_without_correction(b, c, n):
    got = tango(b, c, n)
    ref = sm_tables.mcnemar(np.array([[n - b - c, b], [c, 0]]), exact=False, correction=False)
    assert got.pvalue == pytest.approx(ref.pvalue, rel=1e-9)
    assert got.diff == pytest.approx((b - c) / n, abs=1e-15)
    assert got.test == "Tango score"


@pytest.mark.parametrize("b,c,n", [(0, 0, 30), (0, 5, 100), (9, 2, 31), (7, 1, 12), (40, 25, 300), (3, 0, 3)])
def test_tango_interval_ends_solve_the_score_equation(b, c, n):
    got = tango(b, c, n)
    for end, target in ((got.lo, Z), (got.hi, -Z)):
        if abs(end) < 1 - 1e-9:
            assert tango_z_numeric(b, c, n, end) == pytest.approx(target, abs=1e-4)
    # and the closed-form statistic agrees with the numeric restricted MLE inside the interval
    for delta in np.linspace(got.lo, got.hi, 7)[1:-1]:
        assert score_tests.tango_z((b - c) / n, (b + c) / n, n, delta) == pytest.approx(
            tango_z_numeric(b, c, n, delta), abs=1e-5
        )


def test_tango_p_and_interval_agree_for_every_table_up_to_30():
    """Brute force over every (b, c) with n = 12 and n = 30: p < 0.05 exactly when 0 is outside the interval."""
    for n in (12, 30):
        for b in range(n + 1):
            for c in range(n + 1 - b):
                got = stats.compare_paired(greedy_pairs(b, c, n))
                assert (got.pvalue < 0.05) == (got.lo > 0 or got.hi < 0), (b, c, n, got)
                assert got.hi - got.lo > 0.05, (b, c, n)  # never zero width


# ---------------------------------------------------------------------------------------------- design effect


def test_design_effect_is_one_for_one_sample_and_matches_numpy_otherwise():
    assert stats.unweighted([Fraction(1), Fraction(0)] * 10, 1).effective().design_effect == 1.0
    rng = np.random.default_rng(3)
    k = rng.integers(0, 4, size=40)
    values = [Fraction(int(x), 3) for x in k]
    eff = stats.unweighted(values, 3).effective()
    shares = k / 3
    p = shares.mean()
    expected = min(1.0, max(1 / 3, shares.var(ddof=1) / (p * (1 - p))))
    assert eff.design_effect == pytest.approx(expected, rel=1e-12)
    assert eff.n == pytest.approx(40 / expected, rel=1e-12)
    acc = stats.accuracy_interval([(int(x), 3, 1) for x in k])
    n_eff = 40 / expected
    assert (acc.lo, acc.hi) == pytest.approx(
        sm_proportion.proportion_confint(p * n_eff, n_eff, method="wilson"), abs=1e-12
    )


def test_weighted_effective_matches_the_sandwich_variance():
    """Task weighting: weights 1/n_task; the observed variance of the weighted mean is
    n/(n-1) * sum(w^2 (v - mean)^2) / (sum w)^2 and n_kish = (sum w)^2 / sum w^2."""
    v = np.array([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0.5, 0.5])
    w = np.array([1 / 10] * 10 + [1 / 3] * 3)
    scores = stats.Scores(
        np.array([int(2 * x) for x in v]), 2, np.array([0] * 10 + [1] * 3), (Fraction(1, 10), Fraction(1, 3)), 2
    )
    eff = scores.effective()
    mean = (w * v).sum() / w.sum()
    n_kish = w.sum() ** 2 / (w**2).sum()
    observed = len(v) / (len(v) - 1) * (w**2 * (v - mean) ** 2).sum() / w.sum() ** 2
    bernoulli = (mean - mean**2) / n_kish
    deff = min(1.0, max(0.5, observed / bernoulli))
    assert float(eff.mean) == pytest.approx(mean, abs=1e-15)
    assert eff.n == pytest.approx(n_kish / deff, rel=1e-12)


@pytest.mark.parametrize(
    "b,c,n", [(0, 5, 30), (5, 0, 100), (3, 3, 20), (9, 2, 31), (1, 0, 1), (0, 0, 30), (14, 10, 60)]
)
def test_few_discordant_questions_get_exact_mcnemar_and_an_interval_that_agrees(b, c, n):
    got = stats.compare_paired(greedy_pairs(b, c, n))
    exact = sm_tables.mcnemar(np.array([[n - b - c, b], [c, 0]]), exact=True).pvalue
    assert got.pvalue == pytest.approx(max(exact, tango(b, c, n).pvalue), rel=1e-9)
    # the label names the p printed (was "exact McNemar" also where Tango's larger p was printed)
    assert got.test == (stats.EXACT_NAME if exact >= tango(b, c, n).pvalue else stats.TANGO_LARGER)
    assert (got.pvalue < 0.05) == (got.lo > 0 or got.hi < 0)
    assert got.lo <= tango(b, c, n).lo and got.hi >= tango(b, c, n).hi  # never narrower than Tango's


def test_many_discordant_questions_keep_the_score_test():
    got, ref = stats.compare_paired(greedy_pairs(40, 25, 300)), tango(40, 25, 300)
    assert (got.test, got.pvalue, got.lo, got.hi) == (stats.TEST_NAME, ref.pvalue, ref.lo, ref.hi)


def test_clustering_a_question_over_models_counts_it_once():
    """The same 40 greedy outcomes under 3 models: one question each, not 120 problems."""
    outcomes = [(1, 0)] * 9 + [(0, 1)] * 2 + [(1, 1)] * 20 + [(0, 0)] * 9
    rows = [
        {
            "method_spec_id": method,
            "budget": 64,
            "task_id": 1,
            "sample_id": f"q{i}",
            "model_id": model,
            "protocol_id": 1,
            "generation_id": 1,
            "k": pair[method],
            "m": 1,
            "failed": 0,
            "fired": 0,
        }
        for i, pair in enumerate(outcomes)
        for model in (1, 2, 3)
        for method in (0, 1)
    ]
    results = common_set.results_from_rows([tuple(r[c] for c in QUESTION_CELL_COLUMNS) for r in rows])
    clustered = common_set.common_set(results, [0, 1]).compare(0, 1)
    single = stats.compare_paired(greedy_pairs(9, 2, 40))
    assert (clustered.pvalue, clustered.n, clustered.diff) == (single.pvalue, 40, single.diff)
    as_problems = stats.compare_paired(greedy_pairs(27, 6, 120))  # what treating the cells as problems would claim
    assert as_problems.pvalue < single.pvalue / 10


# ---------------------------------------------------------------------------------------------- multiplicity


def test_holm_matches_statsmodels_and_skips_nan():
    rng = np.random.default_rng(5)
    p = list(rng.uniform(0, 0.2, size=12)) + [math.nan, 0.001, 0.001]
    kept = [x for x in p if not math.isnan(x)]
    ref = iter(sm_multitest.multipletests(kept, method="holm")[1])
    for x, g in zip(p, multiplicity.holm(p)):
        assert math.isnan(g) if math.isnan(x) else g == pytest.approx(next(ref), rel=1e-12)


def test_verdicts():
    many = stats.Comparison(0.1, 0.04, 0.16, 0.001, "t", 100)
    assert stats.verdict(many, 0.001) == "replicates"
    assert stats.verdict(many, 0.2) == "inconclusive"
    assert stats.verdict(stats.Comparison(-0.1, -0.16, -0.04, 0.001, "t", 100), 0.001) == "does not replicate"
    assert stats.verdict(stats.Comparison(-0.02, -0.04, 0.0, 0.01, "t", 100), 0.01, threshold=-0.05) == "replicates"
    assert stats.verdict(stats.NONE, math.nan) == "not measured yet"
    assert stats.verdict(stats.Comparison(0.5, 0.2, 0.8, 0.001, "t", 9), 0.001) == stats.TOO_FEW


def test_pareto_front():
    pts = [(1, 50), (2, 60), (2, 55), (3, 58), (4, 70), (5, 70)]
    assert stats.pareto_front(pts) == [True, True, False, False, True, False]
