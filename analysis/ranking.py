"""Ranks that respect uncertainty: rank intervals from all pairwise paired tests.

Every pair of methods is compared on the same questions (Tango's score test on the per-question
differences, as in :func:`analysis.stats.compare`), the family of pairwise p-values is Holm-adjusted,
and method i's rank interval is ``[1 + #methods significantly better than i, K - #methods
significantly worse than i]``. "Tied with the best" means no method is significantly better.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from itertools import combinations

from kvleague.analysis import multiplicity, score_tests
from kvleague.analysis.stats import ALPHA, Scores


@dataclass(frozen=True)
class RankInterval:
    best: int
    worst: int

    @property
    def tied_with_best(self) -> bool:
        return self.best == 1

    def __str__(self) -> str:
        return str(self.best) if self.best == self.worst else f"{self.best}-{self.worst}"


def rank_intervals(scores: Mapping[Hashable, Scores], alpha: float = ALPHA) -> dict[Hashable, RankInterval]:
    """``scores``: method -> its :class:`~analysis.stats.Scores` on the same questions, in the same
    order, over the same denominator and weights."""
    methods = sorted(scores, key=repr)
    pairs = list(combinations(methods, 2))
    effs = []
    for i, j in pairs:
        a, b = scores[i], scores[j]
        effs.append(
            score_tests.effective_ints(
                a.numerators - b.numerators, a.denominator, a.group, a.group_weights, max(a.max_samples, b.max_samples)
            )
        )
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
