"""The leaderboard's statistics: intervals for an accuracy and paired tests against a reference.

Everything here works on *problem histograms* rather than raw rows, because the SQL layer hands the
dashboard aggregates, not tables: for a method on a set of problems, ``values[j]`` is a per-problem
score (the share of that problem's samples answered correctly, or a paired difference of two such
shares) and ``counts[j]`` is how many problems have that value. A problem list ``[1, 0, 1, 1]`` is
the histogram ``values=[0, 1], counts=[1, 3]``.

* :func:`wilson_interval` - Wilson score interval for k successes in n trials (one greedy sample per
  problem, so the samples are independent Bernoulli trials).
* :func:`bootstrap_interval` - percentile bootstrap over problems of the mean per-problem score (several
  samples per problem: the samples of one problem are not independent, the problems are).
* :func:`mcnemar` - McNemar's test on the discordant pairs of two paired greedy runs: exact binomial
  (two-sided, ``min(1, 2 * P[X <= min(b, c)])`` with X ~ Binomial(b + c, 1/2); the default) or the
  chi-square statistic with continuity correction ``max(0, |b - c| - 1)^2 / (b + c)`` on one degree of
  freedom (statsmodels squares ``|b - c| - 1`` even when b == c, giving 1 / (b + c) there instead of 0).
* :func:`paired_bootstrap` - bootstrap over problems of the mean per-problem difference: percentile
  interval and a two-sided p-value ``min(1, 2 * min(P*[d <= 0], P*[d >= 0]))`` (with the usual +1
  correction), which is below 0.05 exactly when the percentile interval (nearly) excludes zero.
* :func:`compare_paired` - the leaderboard's choice: McNemar (p) for one sample per problem on both
  sides, else the paired bootstrap (p); the difference interval is the paired bootstrap in both cases.

Resampling problems with replacement only matters through how many times each *distinct value* is
drawn, so a bootstrap replicate is drawn as ``Multinomial(n, counts / n)`` over the distinct values:
the same distribution as drawing n problem indices, at a cost that does not grow with n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Iterable, Sequence

import numpy as np

LEVEL = 0.95
N_BOOT = 2000
SEED = 0


def z_value(level: float = LEVEL) -> float:
    """The two-sided normal quantile for ``level`` (1.959964... for 0.95)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    return NormalDist().inv_cdf(0.5 + level / 2)


def wilson_interval(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval for a proportion k/n; ``(nan, nan)`` when n == 0."""
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (math.nan, math.nan)
    z = z_value(level)
    p = k / n
    z2 = z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    lo = 0.0 if k == 0 else max(0.0, centre - half)  # exact ends; no rounding residue at the boundaries
    hi = 1.0 if k == n else min(1.0, centre + half)
    return (lo, hi)


def histogram(values: Iterable[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct values, counts)`` of a list of per-problem values."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    vals, counts = np.unique(arr, return_counts=True)
    return vals, counts.astype(np.int64)


def _as_hist(values: Sequence[float] | np.ndarray, counts: Sequence[int] | np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    if counts is None:
        return histogram(values)
    vals = np.asarray(values, dtype=float)
    cnt = np.asarray(counts, dtype=np.int64)
    if vals.shape != cnt.shape:
        raise ValueError("values and counts must have the same length")
    if np.any(cnt < 0):
        raise ValueError("counts must be >= 0")
    keep = cnt > 0
    return vals[keep], cnt[keep]


def hist_mean(values: Sequence[float] | np.ndarray, counts: Sequence[int] | np.ndarray | None = None) -> float:
    vals, cnt = _as_hist(values, counts)
    n = int(cnt.sum())
    return float(np.dot(vals, cnt) / n) if n else math.nan


def bootstrap_means(
    values: Sequence[float] | np.ndarray,
    counts: Sequence[int] | np.ndarray | None = None,
    n_boot: int = N_BOOT,
    seed: int = SEED,
) -> np.ndarray:
    """``n_boot`` bootstrap replicates of the mean over problems (resampling problems with replacement)."""
    vals, cnt = _as_hist(values, counts)
    n = int(cnt.sum())
    if n == 0:
        return np.zeros(0)
    rng = np.random.default_rng(seed)
    if vals.size == 1:
        return np.full(n_boot, float(vals[0]))
    draws = rng.multinomial(n, cnt / n, size=n_boot)
    return draws @ vals / n


def bootstrap_interval(
    values: Sequence[float] | np.ndarray,
    counts: Sequence[int] | np.ndarray | None = None,
    level: float = LEVEL,
    n_boot: int = N_BOOT,
    seed: int = SEED,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean per-problem value; ``(nan, nan)`` for no problems."""
    means = bootstrap_means(values, counts, n_boot, seed)
    if means.size == 0:
        return (math.nan, math.nan)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return (float(lo), float(hi))


@dataclass(frozen=True)
class McNemar:
    b: int  # discordant: first right, second wrong
    c: int  # discordant: first wrong, second right
    statistic: float  # b (exact) or the corrected chi-square
    pvalue: float
    exact: bool


def _binom_cdf_half(k: int, n: int) -> float:
    """P[X <= k] for X ~ Binomial(n, 1/2), summed in log space (exact enough for any n)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    log_half_n = -n * math.log(2)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + log_half_n for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def mcnemar(b: int, c: int, exact: bool = True) -> McNemar:
    """McNemar's test from the discordant counts b and c (p = 1 when there are none)."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return McNemar(b, c, float(min(b, c)) if exact else 0.0, 1.0, exact)
    if exact:
        p = min(1.0, 2 * _binom_cdf_half(min(b, c), n))
        return McNemar(b, c, float(min(b, c)), p, True)
    stat = (abs(b - c) - 1) ** 2 / n if abs(b - c) >= 1 else 0.0
    p = math.erfc(math.sqrt(stat / 2))  # chi-square survival function, one degree of freedom
    return McNemar(b, c, stat, p, False)


@dataclass(frozen=True)
class PairedBootstrap:
    mean: float
    lo: float
    hi: float
    pvalue: float
    n: int


def paired_bootstrap(
    diffs: Sequence[float] | np.ndarray,
    counts: Sequence[int] | np.ndarray | None = None,
    level: float = LEVEL,
    n_boot: int = N_BOOT,
    seed: int = SEED,
) -> PairedBootstrap:
    """Bootstrap over problems of the mean paired difference (method minus reference per problem)."""
    vals, cnt = _as_hist(diffs, counts)
    n = int(cnt.sum())
    if n == 0:
        return PairedBootstrap(math.nan, math.nan, math.nan, math.nan, 0)
    means = bootstrap_means(vals, cnt, n_boot, seed)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    below = (int(np.count_nonzero(means <= 0)) + 1) / (n_boot + 1)
    above = (int(np.count_nonzero(means >= 0)) + 1) / (n_boot + 1)
    p = min(1.0, 2 * min(below, above))
    return PairedBootstrap(hist_mean(vals, cnt), float(lo), float(hi), p, n)


@dataclass(frozen=True)
class Comparison:
    """Method minus reference on the problems both have."""

    diff: float
    lo: float
    hi: float
    pvalue: float
    test: str  # "McNemar (exact)" or "paired bootstrap"
    n: int  # problems paired
    b: int | None = None  # McNemar's discordant counts (method right / reference wrong, and the reverse)
    c: int | None = None


def compare_paired(
    pairs: Iterable[tuple[int, int, int, int, int]],
    level: float = LEVEL,
    n_boot: int = N_BOOT,
    seed: int = SEED,
) -> Comparison:
    """``pairs``: ``(k_a, m_a, k_b, m_b, count)`` - count problems where the method had k_a of m_a samples
    correct and the reference k_b of m_b. McNemar when every problem has one sample on each side."""
    diffs: dict[float, int] = {}
    single = True
    b = c = 0
    for k_a, m_a, k_b, m_b, count in pairs:
        if not count or not m_a or not m_b:
            continue
        single = single and m_a == 1 and m_b == 1
        d = k_a / m_a - k_b / m_b
        diffs[d] = diffs.get(d, 0) + int(count)
        if m_a == 1 and m_b == 1:
            if k_a and not k_b:
                b += int(count)
            elif k_b and not k_a:
                c += int(count)
    if not diffs:
        return Comparison(math.nan, math.nan, math.nan, math.nan, "none", 0)
    vals = np.array(list(diffs), dtype=float)
    cnt = np.array(list(diffs.values()), dtype=np.int64)
    boot = paired_bootstrap(vals, cnt, level, n_boot, seed)
    if single:
        test = mcnemar(b, c, exact=True)
        return Comparison(boot.mean, boot.lo, boot.hi, test.pvalue, "McNemar (exact)", boot.n, b, c)
    return Comparison(boot.mean, boot.lo, boot.hi, boot.pvalue, "paired bootstrap", boot.n)


@dataclass(frozen=True)
class Accuracy:
    mean: float
    lo: float
    hi: float
    method: str  # "Wilson" or "bootstrap"
    problems: int
    samples: int


def accuracy_interval(
    hist: Iterable[tuple[int, int, int]], level: float = LEVEL, n_boot: int = N_BOOT, seed: int = SEED
) -> Accuracy:
    """``hist``: ``(k, m, count)`` - count problems with k of m samples correct. Wilson when every problem
    has one sample (pooled k/n), else the bootstrap over problems of the per-problem share correct."""
    values: dict[float, int] = {}
    single = True
    k_total = problems = samples = 0
    for k, m, count in hist:
        if not count or not m:
            continue
        single = single and m == 1
        values[k / m] = values.get(k / m, 0) + int(count)
        k_total += int(k) * int(count)
        problems += int(count)
        samples += int(m) * int(count)
    if not problems:
        return Accuracy(math.nan, math.nan, math.nan, "none", 0, 0)
    vals = np.array(list(values), dtype=float)
    cnt = np.array(list(values.values()), dtype=np.int64)
    mean = hist_mean(vals, cnt)
    if single:
        lo, hi = wilson_interval(k_total, problems, level)
        return Accuracy(mean, lo, hi, "Wilson", problems, samples)
    lo, hi = bootstrap_interval(vals, cnt, level, n_boot, seed)
    return Accuracy(mean, lo, hi, "bootstrap", problems, samples)


def verdict_superior(comparison: Comparison, alpha: float = 1 - LEVEL) -> str:
    """A claimed advantage: replicates when significantly better, does not when significantly worse."""
    if comparison.n == 0 or math.isnan(comparison.pvalue):
        return "not measured yet"
    if comparison.pvalue < alpha and comparison.diff > 0:
        return "replicates"
    if comparison.pvalue < alpha and comparison.diff < 0:
        return "does not replicate"
    return "inconclusive"


def verdict_noninferior(comparison: Comparison, margin: float) -> str:
    """A claim of staying within ``margin`` of the reference (e.g. 0.05 = five points below full cache):
    replicates when the whole interval is above -margin, does not when it is entirely below."""
    if comparison.n == 0 or math.isnan(comparison.lo):
        return "not measured yet"
    if comparison.lo > -margin:
        return "replicates"
    if comparison.hi < -margin:
        return "does not replicate"
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
