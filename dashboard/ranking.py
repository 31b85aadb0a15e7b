"""Ranks that respect uncertainty: rank intervals from all pairwise paired tests.

Every pair of methods is compared on the same questions (Tango's score test on the per-question
differences, as in :func:`dashboard.stats.compare`), the family of pairwise p-values is Holm-adjusted,
and method i's rank interval is ``[1 + #methods significantly better than i, K - #methods
significantly worse than i]``. "Tied with the best" means no method is significantly better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from typing import Hashable, Mapping, Sequence

import numpy as np

from dashboard import multiplicity, score_tests
from dashboard.stats import ALPHA


@dataclass(frozen=True)
class RankInterval:
    best: int
    worst: int

    @property
    def tied_with_best(self) -> bool:
        return self.best == 1

    def __str__(self) -> str:
        return str(self.best) if self.best == self.worst else f"{self.best}-{self.worst}"


def rank_intervals(
    scores: Mapping[Hashable, Sequence[Fraction]], weights: Sequence[Fraction], max_samples: int, alpha: float = ALPHA
) -> dict[Hashable, RankInterval]:
    """``scores``: method -> per-question scores, every method on the same questions in the same order."""
    methods = sorted(scores, key=repr)
    denominator = math.lcm(*{v.denominator for m in methods for v in scores[m]}) if methods else 1
    dtype = np.int64 if denominator <= 2**20 else object
    ints = {m: np.array([v.numerator * (denominator // v.denominator) for v in scores[m]], dtype=dtype) for m in methods}
    distinct = sorted(set(weights))
    index = {w: i for i, w in enumerate(distinct)}
    group = np.array([index[w] for w in weights], dtype=np.int64)
    pairs = list(combinations(methods, 2))
    effs = [score_tests.effective_ints(ints[i] - ints[j], denominator, group, distinct, max_samples) for i, j in pairs]
    raw = [1.0 if e.mean == 0 else score_tests.tango_pvalue(float(e.mean), float(e.abs_mean), e.n) for e in effs]
    adjusted = multiplicity.holm(raw)
    better = {m: 0 for m in methods}  # how many methods are significantly better than m
    worse = {m: 0 for m in methods}
    for (i, j), e, p in zip(pairs, effs, adjusted):
        if p < alpha:
            winner, loser = (i, j) if e.mean > 0 else (j, i)
            better[loser] += 1
            worse[winner] += 1
    k = len(methods)
    return {m: RankInterval(1 + better[m], k - worse[m]) for m in methods}
