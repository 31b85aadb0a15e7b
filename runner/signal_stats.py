"""Spearman's rho between a signal and an importance label, pooled over samples as the EpiKV authors pool
(``scripts/signal_ablation.py``: one ``spearmanr`` over every labelled token of every trace), with a
95% bootstrap interval that resamples *samples* (the sample is the unit; its tokens travel together).

A bootstrap resample repeats some samples; pooling a repeated sample means its tokens appear several
times. Rather than building each resampled array, the resample is a vector of per-token multiplicities
and the ranks are the tied ranks of the weighted data (a token repeated w times, tied with itself,
takes the mean rank of its w copies), so one sort per signal serves every resample. The result equals
``scipy.stats.spearmanr`` on the explicitly concatenated resample (tests/test_signals.py checks it);
the interval is ``scipy.stats.bootstrap``'s percentile interval over sample indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass
class Correlation:
    rho: float
    lo: float
    hi: float
    p_value: float
    n_samples: int
    n_pairs: int


def pooled_spearman(signal: list[np.ndarray], label: list[np.ndarray]) -> tuple[float, float, int]:
    """(rho, p, pairs) of one spearmanr over every token of every sample, NaN signal values dropped."""
    x, y = np.concatenate(signal), np.concatenate(label)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3 or np.ptp(x[keep]) == 0 or np.ptp(y[keep]) == 0:
        return float("nan"), float("nan"), int(keep.sum())
    res = stats.spearmanr(x[keep], y[keep])
    return float(res.statistic), float(res.pvalue), int(keep.sum())


def _weighted_ranks(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Tied (average) ranks of each value in the multiset where value i appears ``weights[b, i]`` times,
    for every resample b at once: ``[B, N]``."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.flatnonzero(np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]]))
    group_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(values))))
    w = weights[:, order]
    group_weight = np.add.reduceat(w, starts, axis=1)
    below = np.cumsum(group_weight, axis=1) - group_weight
    group_rank = below + (group_weight + 1) / 2.0
    ranks = np.empty_like(w, dtype=np.float64)
    ranks[:, order] = group_rank[:, group_of]
    return ranks


def _weighted_pearson(a: np.ndarray, b: np.ndarray, w: np.ndarray) -> np.ndarray:
    total = w.sum(axis=1, keepdims=True)
    ma, mb = (w * a).sum(1, keepdims=True) / total, (w * b).sum(1, keepdims=True) / total
    da, db = a - ma, b - mb
    cov = (w * da * db).sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return cov / np.sqrt((w * da * da).sum(1) * (w * db * db).sum(1))


class SampleBootstrap:
    """Resamples of the samples shared by every signal of one label, so all signals see the same
    resamples (their intervals are comparable) and the label's ranks are computed once."""

    def __init__(self, label: list[np.ndarray], n_resamples: int = 1000, seed: int = 0):
        self.label = label
        self.sizes = np.array([len(x) for x in label])
        self.owner = np.repeat(np.arange(len(label)), self.sizes)
        self.n_resamples = n_resamples
        self.seed = seed

    def correlate(self, signal: list[np.ndarray]) -> Correlation:
        rho, p, pairs = pooled_spearman(signal, self.label)
        n = len(self.label)
        if not np.isfinite(rho) or n < 2:
            return Correlation(rho, float("nan"), float("nan"), p, n, pairs)
        x, y = np.concatenate(signal), np.concatenate(self.label)
        keep = np.isfinite(x) & np.isfinite(y)
        x, y, owner = x[keep], y[keep], self.owner[keep]

        def statistic(idx: np.ndarray, axis: int = -1) -> np.ndarray:
            idx = np.atleast_2d(idx)
            counts = np.zeros((idx.shape[0], n))
            np.add.at(counts, (np.arange(idx.shape[0])[:, None], idx), 1.0)
            w = counts[:, owner]
            return _weighted_pearson(_weighted_ranks(x, w), _weighted_ranks(y, w), w)

        res = stats.bootstrap((np.arange(n),), statistic, vectorized=True, n_resamples=self.n_resamples,
                              batch=100, method="percentile", random_state=np.random.default_rng(self.seed))
        lo, hi = res.confidence_interval
        return Correlation(rho, float(lo), float(hi), p, n, pairs)
