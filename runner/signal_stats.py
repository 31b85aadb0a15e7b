"""Spearman's rho between a signal and an importance label, pooled over samples as the EpiKV authors pool
(``scripts/signal_ablation.py``: one ``spearmanr`` over every labelled token of every trace), with a
95% bootstrap interval that resamples *samples* (the sample is the unit; its tokens travel together).

A bootstrap resample repeats some samples; pooling a repeated sample means its tokens appear several
times. Rather than building each resampled array, a resample is a vector m of per-sample multiplicities.
The tied (average) rank of token t in it is ``R_t = sum_s m_s A[t, s] + 1/2``, where ``A[t, s]`` counts
sample s's tokens below t's value plus half those equal to it; the mean rank is ``(W + 1) / 2`` for W
pooled tokens; and the multiplicity-weighted sums of ``R^x R^y`` (and squares) are cubic forms in m of
per-sample tensors ``K[u, s, s'] = sum_{t in u} A^x[t, s] A^y[t, s']``. So each resample's rho costs
O(S^3) for S samples, whatever the number of tokens, and equals ``scipy.stats.spearmanr`` on the
explicitly concatenated resample (tests/test_signals.py checks it). The interval is
``scipy.stats.bootstrap``'s percentile interval over sample indices.
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


def _rank_counts(values: np.ndarray, owner: np.ndarray, n_samples: int) -> np.ndarray:
    """``[N, S]``: for each token, the tokens of each sample below its value plus half those equal to it."""
    out = np.zeros((len(values), n_samples))
    for s in range(n_samples):
        mine = np.sort(values[owner == s])
        less = np.searchsorted(mine, values, "left")
        out[:, s] = less + (np.searchsorted(mine, values, "right") - less) / 2.0
    return out


class _RankMoments:
    """The per-sample tensors that give every resample's weighted rank sums (see the module docstring)."""

    def __init__(self, x_counts: np.ndarray, y_counts: np.ndarray, owner: np.ndarray, n_samples: int):
        self.sizes = np.bincount(owner, minlength=n_samples).astype(np.float64)
        groups = [owner == u for u in range(n_samples)]
        self.xy = np.stack([x_counts[g].T @ y_counts[g] for g in groups])  # [u, s, s']
        self.xx = np.stack([x_counts[g].T @ x_counts[g] for g in groups])
        self.yy = np.stack([y_counts[g].T @ y_counts[g] for g in groups])
        self.x_sum = np.stack([x_counts[g].sum(0) for g in groups])  # [u, s]
        self.y_sum = np.stack([y_counts[g].sum(0) for g in groups])

    def rho(self, m: np.ndarray) -> np.ndarray:
        """Pearson's r of the tied ranks of x and y in each resample (rows of m: multiplicities)."""
        total = m @ self.sizes
        mean = (total + 1) / 2.0

        def cross(k, a_sum, b_sum):  # sum over pooled copies of R^a R^b
            inner = np.tensordot(m, k, axes=([1], [1]))  # [b, u, t] = sum_s m_s K[u, s, t]
            quad = ((inner * m[:, None, :]).sum(2) * m).sum(1)
            lin = 0.5 * (((m @ a_sum.T) * m).sum(1) + ((m @ b_sum.T) * m).sum(1))
            return quad + lin + 0.25 * total

        cov = cross(self.xy, self.x_sum, self.y_sum) - total * mean**2
        var_x = cross(self.xx, self.x_sum, self.x_sum) - total * mean**2
        var_y = cross(self.yy, self.y_sum, self.y_sum) - total * mean**2
        with np.errstate(invalid="ignore", divide="ignore"):
            return cov / np.sqrt(var_x * var_y)


class SampleBootstrap:
    """Resamples of the samples shared by every signal of one label, so all signals see the same
    resamples (their intervals are comparable) and the label's ranks are computed once."""

    def __init__(self, label: list[np.ndarray], n_resamples: int = 1000, seed: int = 0):
        self.label = label
        self.owner = np.repeat(np.arange(len(label)), [len(x) for x in label])
        self.n_resamples = n_resamples
        self.seed = seed

    def correlate(self, signal: list[np.ndarray], interval: bool = True) -> Correlation:
        """Pooled rho (and p) of ``signal``; with ``interval``, its 95% bootstrap interval over samples."""
        rho, p, pairs = pooled_spearman(signal, self.label)
        n = len(self.label)
        if not interval or not np.isfinite(rho) or n < 2:
            return Correlation(rho, float("nan"), float("nan"), p, n, pairs)
        x, y = np.concatenate(signal), np.concatenate(self.label)
        keep = np.isfinite(x) & np.isfinite(y)
        x, y, owner = x[keep], y[keep], self.owner[keep]
        moments = _RankMoments(_rank_counts(x, owner, n), _rank_counts(y, owner, n), owner, n)

        def statistic(idx: np.ndarray, axis: int = -1) -> np.ndarray:
            idx = np.atleast_2d(idx)
            m = np.zeros((idx.shape[0], n))
            np.add.at(m, (np.arange(idx.shape[0])[:, None], idx), 1.0)
            return moments.rho(m)

        res = stats.bootstrap((np.arange(n),), statistic, vectorized=True, n_resamples=self.n_resamples,
                              batch=100, method="percentile", random_state=np.random.default_rng(self.seed))
        lo, hi = res.confidence_interval
        return Correlation(rho, float(lo), float(hi), p, n, pairs)
