"""Score tests and the intervals that invert them, for means of per-question values.

Two families, each a test of ``H0: mean = delta`` whose acceptance region over ``delta`` *is* the
interval, so a p-value below alpha and an interval excluding the tested value always go together:

* accuracy (values in [0, 1]): Wilson's score test and interval;
* paired difference (values in [-1, 1], method minus reference): Tango's score test and interval for
  matched pairs (Tango 1998, Stat. Med. 17:891). At ``delta = 0`` Tango's statistic is McNemar's
  ``(b - c) / sqrt(b + c)`` without continuity correction.

Both are derived for one Bernoulli outcome per question. A question scored over several samples or
several cells (models, seeds, generation settings) has a *smaller* variance than a Bernoulli value
of the same mean, so the data are first summarised as :class:`Effective` counts: the observed variance
of the (weighted) mean divided by the Bernoulli-equivalent one is the design effect, clipped to
``[1 / max samples per question, 1]`` (never more optimistic than independent samples, never zero
width), and the effective number of questions is ``n_kish / deff``. With one sample per question the
design effect is 1 and both reduce exactly to the textbook Wilson and Tango procedures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm

ROOT_TOLERANCE = 1e-12


@dataclass(frozen=True)
class Effective:
    """A weighted mean over questions as Bernoulli-equivalent counts: ``n`` effective questions,
    ``mean`` and ``abs_mean`` (mean of |value|: the discordant share for a paired difference)."""

    mean: Fraction
    abs_mean: Fraction
    n: float
    questions: int
    design_effect: float


def effective_ints(
    numerators: np.ndarray, denominator: int, group: np.ndarray, group_weights: Sequence[Fraction], max_samples: int
) -> Effective:
    """Exact weighted mean and mean |value| of per-question values ``numerators / denominator`` (question
    i weighing ``group_weights[group[i]]``), and the design effect: integer power sums per weight group
    (weights scaled to integers), divided out once at the end, so equal data give bitwise equal results
    in any order."""
    n = len(numerators)
    if n == 0:
        return Effective(Fraction(0), Fraction(0), 0.0, 0, math.nan)
    scale = math.lcm(*(w.denominator for w in group_weights))
    total = s_v = s_a = s_w2 = s_w2v = s_w2v2 = 0  # sums of w, w v, w |v|, w^2, w^2 v, w^2 v^2 (scaled)
    for g, w in enumerate(group_weights):
        x = numerators if len(group_weights) == 1 else numerators[group == g]
        if not len(x):
            continue
        iw = int(w * scale)
        count, s1, sa, s2 = len(x), int(x.sum()), int(np.abs(x).sum()), int((x * x).sum())
        total += iw * count
        s_v += iw * s1
        s_a += iw * sa
        s_w2 += iw * iw * count
        s_w2v += iw * iw * s1
        s_w2v2 += iw * iw * s2
    mean = Fraction(s_v, total * denominator)
    abs_mean = Fraction(s_a, total * denominator)
    n_kish = Fraction(total * total, s_w2)
    bernoulli = (abs_mean - mean * mean) / n_kish  # variance of the mean if each value were one draw in {-1, 0, 1}
    deff = Fraction(1)
    if n > 1 and bernoulli > 0:
        # sum of w^2 (v - mean)^2, over scale^2 like total^2
        spread = (
            Fraction(s_w2v2, denominator * denominator) - 2 * mean * Fraction(s_w2v, denominator) + mean * mean * s_w2
        )
        observed = Fraction(n, n - 1) * spread / (total * total)
        deff = min(Fraction(1), max(Fraction(1, max(1, max_samples)), observed / bernoulli))
    return Effective(mean, abs_mean, float(n_kish / deff), n, float(deff))


@lru_cache(maxsize=8)
def _root(*args: Any, **kwargs: Any) -> float:
    """``brentq``'s root (scipy declares its result loosely)."""
    root: Any = brentq(*args, **kwargs)
    return float(root)


def critical_z(level: float) -> float:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    return float(norm.ppf(0.5 + level / 2))


# ------------------------------------------------------------------------------------------------
# Wilson (accuracy)
# ------------------------------------------------------------------------------------------------


def wilson_z(p_hat: float, n: float, p0: float) -> float:
    """Wilson's score statistic for ``H0: proportion = p0``."""
    if p0 <= 0 or p0 >= 1:
        return 0.0 if p_hat == p0 else math.copysign(math.inf, p_hat - p0)
    return (p_hat - p0) / math.sqrt(p0 * (1 - p0) / n)


def wilson_bounds(p_hat: float, n: float, level: float) -> tuple[float, float]:
    """The Wilson interval for a proportion ``p_hat`` on ``n`` (possibly effective, non-integer) trials."""
    z = critical_z(level)
    z2 = z * z
    denom = 1 + z2 / n
    centre = (p_hat + z2 / (2 * n)) / denom
    half = z * math.sqrt(max(0.0, p_hat * (1 - p_hat)) / n + z2 / (4 * n * n)) / denom
    lo = 0.0 if p_hat <= 0 else max(0.0, centre - half)  # exact ends: no rounding residue at the boundaries
    hi = 1.0 if p_hat >= 1 else min(1.0, centre + half)
    return lo, hi


# ------------------------------------------------------------------------------------------------
# Tango (paired difference)
# ------------------------------------------------------------------------------------------------


def tango_z(mean: float, abs_mean: float, n: float, delta: float) -> float:
    """Tango's score statistic for ``H0: difference = delta``. ``mean`` = (b - c) / n and ``abs_mean`` =
    (b + c) / n; the variance uses the restricted maximum-likelihood discordance."""
    # restricted MLE of the reverse-discordant share p21 under p12 - p21 = delta: the positive root of
    # 2 p^2 + B p + C = 0 (Tango's quadratic divided by n)
    b = -abs_mean + (2 - mean) * delta
    c = -(abs_mean - mean) / 2 * delta * (1 - delta)
    p21 = (-b + math.sqrt(max(b * b - 8 * c, 0.0))) / 4
    var = max(2 * p21 + delta * (1 - delta), 0.0)
    num = math.sqrt(n) * (mean - delta)
    if var > 0:
        return num / math.sqrt(var)
    return 0.0 if num == 0 else math.copysign(math.inf, num)


def tango_pvalue(mean: float, abs_mean: float, n: float, delta: float = 0.0) -> float:
    """Two-sided p of Tango's score test."""
    return two_sided_p(tango_z(mean, abs_mean, n, delta))


def two_sided_p(z: float) -> float:
    """``2 * P[N(0, 1) > |z|]``."""
    return math.erfc(abs(z) / math.sqrt(2))


@lru_cache(maxsize=1 << 16)  # a pure function of four floats; a leaderboard of many methods repeats them often
def tango_bounds(mean: float, abs_mean: float, n: float, level: float) -> tuple[float, float]:
    """Tango's interval ``{delta: |z(delta)| <= z_crit}``: z decreases in delta, so each end is the root of
    ``z = +-z_crit`` between -1 (or 1) and the estimate, or -1 (1) itself when z never gets there."""
    zc = critical_z(level)
    lo = (
        -1.0
        if tango_z(mean, abs_mean, n, -1.0) <= zc
        else _root(lambda d: tango_z(mean, abs_mean, n, d) - zc, -1.0, mean, xtol=ROOT_TOLERANCE)
    )
    hi = (
        1.0
        if tango_z(mean, abs_mean, n, 1.0) >= -zc
        else _root(lambda d: tango_z(mean, abs_mean, n, d) + zc, mean, 1.0, xtol=ROOT_TOLERANCE)
    )
    return lo, hi
