"""Simulated leaderboards with a known truth, to measure how the statistics behave: the rejection rate
of each test under a true null and the coverage of each interval, per number of questions and
samples per question. Used by tests/test_stats_calibration.py (asserted) and
runner/bench/stats_calibration.py (the table in docs/statistics.md).

A question has a latent solve rate ``p ~ Beta(a, b)``; each method draws ``k ~ Binomial(m, p')`` with
``p' = p`` for the reference and ``p' = clip(p + shift)`` for the method, independently. ``m = 1`` is
a greedy run (one outcome per question), ``m = 3`` three seeds - or three models clustered in one
question, which behaves the same way. The data are drawn vectorised; every replicate then goes
through the same code as the dashboard (:func:`analysis.score_tests.effective_ints` and
:mod:`analysis.stats`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import numpy as np
from scipy import integrate

from kvleague.analysis import score_tests, stats

SHAPE = (2.0, 2.0)  # solve rates spread over (0, 1), mean 0.5
ALTERNATIVE_SHIFT = 0.1
ONE_WEIGHT = [Fraction(1)]


@dataclass(frozen=True)
class Calibration:
    procedure: str
    n: int
    samples: int
    reps: int
    rejection: float  # share of replicates where the test rejects the true value at 5%
    coverage: float  # share of replicates whose 95% interval contains the true value


@lru_cache(maxsize=16)
def true_difference(shift: float, shape: tuple[float, float] = SHAPE) -> float:
    """``E[clip(p + shift, 0, 1) - p]`` for ``p ~ Beta(shape)``."""
    a, b = shape
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)

    def integrand(p: float) -> float:
        density = math.exp((a - 1) * math.log(p) + (b - 1) * math.log1p(-p) - log_beta) if 0 < p < 1 else 0.0
        return (min(1.0, max(0.0, p + shift)) - p) * density

    return float(integrate.quad(integrand, 0, 1, points=[1 - shift, -shift], limit=200)[0])


def draw(
    rng: np.random.Generator, n: int, m: int, reps: int, shift: float, shape=SHAPE
) -> tuple[np.ndarray, np.ndarray]:
    """``(k_method, k_reference)``, each ``(reps, n)`` correct counts out of ``m``."""
    p = rng.beta(*shape, size=(reps, n))
    return rng.binomial(m, np.clip(p + shift, 0, 1)), rng.binomial(m, p)


def _group(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int64)


def paired(n: int, m: int, reps: int, shift: float = 0.0, seed: int = 0, level: float = stats.LEVEL) -> Calibration:
    """Tango's score test of difference = truth and its interval, on method minus reference."""
    truth = 0.0 if shift == 0 else true_difference(shift)
    k_a, k_b = draw(np.random.default_rng(seed), n, m, reps, shift)
    reject = cover = 0
    for row in k_a - k_b:
        c = stats.comparison_from(score_tests.effective_ints(row, m, _group(n), ONE_WEIGHT, m), level)
        p = c.pvalue if truth == 0 else stats.shifted_pvalue(c, truth)
        reject += p < 1 - level
        cover += c.lo <= truth <= c.hi
    name = f"paired difference (Tango), {'null' if shift == 0 else f'Δ = +{shift:g} shift'}"
    return Calibration(name, n, m, reps, reject / reps, cover / reps)


def accuracy(n: int, m: int, reps: int, seed: int = 0) -> Calibration:
    """Wilson's score test of accuracy = truth (the paper-value check) and its interval."""
    a, b = SHAPE
    truth = a / (a + b)
    k, _ = draw(np.random.default_rng(seed), n, m, reps, 0.0)
    reject = cover = 0
    for row in k:
        acc = stats.accuracy_from(score_tests.effective_ints(row, m, _group(n), ONE_WEIGHT, m))
        reject += score_tests.two_sided_p(score_tests.wilson_z(acc.mean, acc.n_effective, truth)) < stats.ALPHA
        cover += acc.lo <= truth <= acc.hi
    return Calibration("accuracy (Wilson, design effect)", n, m, reps, reject / reps, cover / reps)
