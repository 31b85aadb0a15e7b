"""The leaderboard's statistics: accuracy intervals, paired comparisons and verdicts, on questions.

The statistical unit is a *question*: one ``sample_id`` of one task. A question can have several
*cells* (models, protocols, generation settings) and each cell several samples (seeds); a question's
score is the mean over its cells of the share of samples correct, and a paired difference is the
mean over the cells both methods have of (method share - reference share). Scores are exact
fractions, so sums, ties and signs are exact and do not depend on the order of the rows.

* :func:`accuracy` - the mean score with Wilson's score interval (design effect for several samples
  or cells per question: :mod:`analysis.score_tests`).
* :func:`compare` - the mean difference with Tango's score interval and the p-value of the same score
  test (McNemar's statistic without continuity correction at 0), so "p < 0.05" and "the interval
  excludes 0" never disagree. When every question is concordant or wholly discordant (one greedy
  sample, or identical cells) and fewer than :data:`EXACT_DISCORDANT` are discordant the asymptotic test is too optimistic (b = 0, c = 5: p 0.025), so the p-value
  is exact McNemar's (0.0625) and the interval reaches 0 when it does not reject (:func:`exact_small`).
  :func:`shifted_pvalue` tests another value (a non-inferiority margin).
* :func:`verdict` - replicates / does not replicate / inconclusive from an (adjusted) p-value, or
  "too few problems" below :data:`MIN_PROBLEMS` questions, where the calibration (docs/statistics.md)
  does not hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache

import numpy as np
from scipy.stats import binomtest

from kvleague.analysis import score_tests as st

LEVEL = 0.95
ALPHA = 1 - LEVEL
MIN_PROBLEMS = 10  # below this many questions no verdict is given (see docs/statistics.md)
TOO_FEW = f"too few problems (n < {MIN_PROBLEMS})"
NOT_MEASURED = "not measured yet"


# ------------------------------------------------------------------------------------------------
# Per-question values
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scores:
    """Per-question values ``numerators / denominator`` (exact), question i weighing
    ``group_weights[group[i]]``, and the most samples behind one question (for the design effect)."""

    numerators: np.ndarray
    denominator: int
    group: np.ndarray
    group_weights: tuple[Fraction, ...]
    max_samples: int

    @property
    def n(self) -> int:
        return len(self.numerators)

    def effective(self) -> st.Effective:
        return st.effective_ints(self.numerators, self.denominator, self.group, self.group_weights, self.max_samples)


def unweighted(values: Sequence[Fraction], max_samples: int) -> Scores:
    """Equally weighted questions from exact values."""
    denominator = math.lcm(*{v.denominator for v in values}) if values else 1
    numerators = np.array(
        [v.numerator * (denominator // v.denominator) for v in values],
        dtype=np.int64 if denominator <= 2**20 else object,
    )
    return Scores(numerators, denominator, np.zeros(len(values), dtype=np.int64), (Fraction(1),), max(1, max_samples))


# ------------------------------------------------------------------------------------------------
# Accuracy
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accuracy:
    mean: float
    lo: float
    hi: float
    method: str  # "Wilson" or "Wilson, design effect"
    problems: int  # questions
    samples: int
    design_effect: float = 1.0
    n_effective: float = math.nan


def accuracy(scores: Scores, samples: int = 0, level: float = LEVEL) -> Accuracy:
    if scores.n == 0:
        return Accuracy(math.nan, math.nan, math.nan, "none", 0, 0, math.nan, math.nan)
    return accuracy_from(scores.effective(), samples, level)


def accuracy_from(eff: st.Effective, samples: int = 0, level: float = LEVEL) -> Accuracy:
    mean = float(eff.mean)
    lo, hi = st.wilson_bounds(mean, eff.n, level)
    method = "Wilson" if eff.design_effect == 1 else "Wilson, design effect"
    return Accuracy(mean, lo, hi, method, eff.questions, samples, eff.design_effect, eff.n)


def accuracy_interval(hist: Iterable[tuple[int, int, int]], level: float = LEVEL) -> Accuracy:
    """``hist``: ``(k, m, count)`` - count independent questions with k of m samples correct."""
    values: list[Fraction] = []
    samples = max_m = 0
    for k, m, count in hist:
        if count and m:
            values += [Fraction(int(k), int(m))] * int(count)
            samples += int(m) * int(count)
            max_m = max(max_m, int(m))
    return accuracy(unweighted(sorted(values), max_m), samples, level)


# ------------------------------------------------------------------------------------------------
# Paired comparison
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """Method minus reference on the questions both have."""

    diff: float
    lo: float
    hi: float
    pvalue: float
    test: str
    n: int  # questions paired
    abs_mean: float = math.nan  # mean |difference|: the discordant share for one sample per question
    n_effective: float = math.nan
    design_effect: float = math.nan


NONE = Comparison(math.nan, math.nan, math.nan, math.nan, "none", 0)
TEST_NAME = "Tango score"
EXACT_NAME = "exact McNemar"
#: where Tango's asymptotic p is larger than exact McNemar's and is the one printed
TANGO_LARGER = "Tango score (asymptotic; larger than exact McNemar)"
#: below this many discordant questions (one sample each) the test is exact McNemar's: the usual rule
#: for when the normal approximation to the binomial of b among b + c is not to be trusted
EXACT_DISCORDANT = 25


def compare(diffs: Scores, level: float = LEVEL) -> Comparison:
    if diffs.n == 0:
        return NONE
    c = comparison_from(diffs.effective(), level)
    whole = (diffs.numerators == 0) | (abs(diffs.numerators) == diffs.denominator)
    if len(diffs.group_weights) == 1 and whole.all():  # every question concordant or wholly discordant: a 2x2 table
        b, d = int((diffs.numerators > 0).sum()), int((diffs.numerators < 0).sum())
        if b + d < EXACT_DISCORDANT:
            return exact_small(c, b, d, level)
    return c


@lru_cache(maxsize=1 << 16)  # (b, n) repeat across the many pairs of a large leaderboard
def exact_mcnemar(b: int, n: int) -> float:
    """Two-sided exact McNemar p: the binomial test of ``b`` among ``n`` discordant pairs at 1/2."""
    return float(binomtest(b, n, 0.5).pvalue) if n else 1.0


def exact_small(c: Comparison, b: int, d: int, level: float = LEVEL) -> Comparison:
    """``c`` (Tango's, on a 2x2 table of questions) with ``b`` questions where the method alone is right and
    ``d`` where the reference alone is: p is the larger of exact McNemar's (binomial of b among b + d at
    1/2) and Tango's, and where that p does not reject, Tango's interval is stretched to reach 0, so that
    p < 1 - level exactly when the interval excludes 0. :func:`shifted_pvalue` keeps values between 0 and
    the estimate in step (a test that cannot reject 0 cannot reject them either)."""
    exact = exact_mcnemar(b, b + d)
    p = max(exact, c.pvalue)
    lo, hi = c.lo, c.hi
    if not p < 1 - level:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    # the label names the p printed: exact McNemar's, or Tango's asymptotic one where it is the larger
    return replace(c, lo=lo, hi=hi, pvalue=p, test=EXACT_NAME if exact >= c.pvalue else TANGO_LARGER)


def comparison_from(eff: st.Effective, level: float = LEVEL) -> Comparison:
    mean, abs_mean = float(eff.mean), float(eff.abs_mean)
    lo, hi = st.tango_bounds(mean, abs_mean, eff.n, level)
    p = 1.0 if eff.mean == 0 else st.tango_pvalue(mean, abs_mean, eff.n)  # an exact tie is no evidence
    test = TEST_NAME if eff.design_effect == 1 else f"{TEST_NAME}, design effect"
    return Comparison(mean, lo, hi, p, test, eff.questions, abs_mean, eff.n, eff.design_effect)


def compare_paired(pairs: Iterable[tuple[int, int, int, int, int]], level: float = LEVEL) -> Comparison:
    """``pairs``: ``(k_a, m_a, k_b, m_b, count)`` - count independent questions where the method had k_a of
    m_a samples correct and the reference k_b of m_b."""
    values: list[Fraction] = []
    max_m = 0
    for k_a, m_a, k_b, m_b, count in pairs:
        if count and m_a and m_b:
            values += [Fraction(int(k_a), int(m_a)) - Fraction(int(k_b), int(m_b))] * int(count)
            max_m = max(max_m, int(m_a), int(m_b))
    return compare(unweighted(sorted(values), max_m), level)


def shifted_pvalue(c: Comparison, delta: float) -> float:
    """Two-sided p of the same score test for ``H0: difference = delta`` (e.g. minus a margin); at 0, the
    comparison's own p. Where :func:`compare` chose exact McNemar, a ``delta`` between 0 and the estimate
    is rejected only if 0 is (its p is at least the p at 0), as the interval says."""
    if c.n == 0:
        return math.nan
    if delta == 0:
        return c.pvalue
    p = st.tango_pvalue(c.diff, c.abs_mean, c.n_effective, delta)
    if c.test in (EXACT_NAME, TANGO_LARGER) and min(0.0, c.diff) <= delta <= max(0.0, c.diff):
        return max(p, c.pvalue)
    return p


# ------------------------------------------------------------------------------------------------
# Verdicts
# ------------------------------------------------------------------------------------------------


def verdict(c: Comparison, pvalue: float, threshold: float = 0.0, alpha: float = ALPHA) -> str:
    """A claim that the method is above ``threshold`` (0: better than the reference; minus a margin:
    close to it): replicates when the (adjusted) test of ``difference = threshold`` rejects with the
    estimate above, does not replicate when it rejects with the estimate below."""
    if c.n == 0 or pvalue is None or math.isnan(pvalue):
        return NOT_MEASURED
    if c.n < MIN_PROBLEMS:
        return TOO_FEW
    if pvalue < alpha:
        return "replicates" if c.diff > threshold else "does not replicate"
    return "inconclusive"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For (cost, value) points: True where no other point has cost <= and value >= with one strict."""
    out = []
    for i, (ci, vi) in enumerate(points):
        dominated = False
        for j, (cj, vj) in enumerate(points):
            if j != i and cj <= ci and vj >= vi and (cj < ci or vj > vi):
                dominated = True
                break
        out.append(not dominated)
    return out
