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

**Controlling for position.** Labels and signals both drift with the token's position (the rolling
mean is a running mean over the first tokens; the first window holds the chat template and the
attention sink), so ``SampleBootstrap.partial`` gives the rank partial correlation of signal x and
label y with the position z held fixed: ``r_xy.z = (r_xy - r_xz r_yz) / sqrt((1 - r_xz^2)(1 - r_yz^2))``
from the three pooled Spearman rhos, which equals Pearson's r of the residuals of x's and y's pooled
ranks regressed on z's. Every bootstrap resample computes the three rhos on the same multiplicities.
z is the *absolute* token index, not the index relative to the context length: the mechanisms that
tie labels and signals to position (the attention sink and chat template at the first tokens, the
warm-up of the trailing mean over the first ``rolling`` tokens) sit at fixed absolute indices, and on
the first SmolLM2-135M run absolute position was the stronger confound where contexts differ in
length (rho with the label -0.50 vs -0.32 relative on math500, -0.49 vs -0.36 on humaneval; equal on
niah, whose contexts all have one length).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import cast

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
    rho, p = cast("tuple[float, float]", stats.spearmanr(x[keep], y[keep]))
    return float(rho), float(p), int(keep.sum())


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


def partial_from_rhos(r_xy, r_xz, r_yz):
    """The partial correlation of x and y given z from the three pairwise correlations."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (r_xy - r_xz * r_yz) / np.sqrt((1 - r_xz**2) * (1 - r_yz**2))


def pooled_partial_spearman(
    signal: list[np.ndarray], label: list[np.ndarray], control: list[np.ndarray]
) -> tuple[float, float, int]:
    """(rho, p, pairs): the rank partial correlation of signal and label given control, pooled over every
    token of every sample (tokens with a non-finite value dropped); p from the t test with pairs - 3
    degrees of freedom, as nominal as ``spearmanr``'s (tokens of one sample are not independent)."""
    x, y, z = np.concatenate(signal), np.concatenate(label), np.concatenate(control)
    keep = np.isfinite(x) & np.isfinite(y) & np.isfinite(z)
    n = int(keep.sum())
    if n < 4 or min(np.ptp(v[keep]) for v in (x, y, z)) == 0:
        return float("nan"), float("nan"), n
    rx, ry, rz = (stats.rankdata(v[keep]) for v in (x, y, z))
    r = float(partial_from_rhos(*(np.corrcoef(a, b)[0, 1] for a, b in ((rx, ry), (rx, rz), (ry, rz)))))
    if not np.isfinite(r):
        return float("nan"), float("nan"), n
    t = r * np.sqrt((n - 3) / max(1e-300, 1 - r * r))
    return r, float(2 * stats.t.sf(abs(t), n - 3)), n


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
        lo, hi = self._interval(moments.rho)
        return Correlation(rho, lo, hi, p, n, pairs)

    def partial(self, signal: list[np.ndarray], control: list[np.ndarray], interval: bool = True) -> Correlation:
        """The rank partial correlation of ``signal`` and the label given ``control`` (see the module
        docstring), pooled; with ``interval``, its 95% bootstrap interval on ``correlate``'s resamples."""
        rho, p, pairs = pooled_partial_spearman(signal, self.label, control)
        n = len(self.label)
        if not interval or not np.isfinite(rho) or n < 2:
            return Correlation(rho, float("nan"), float("nan"), p, n, pairs)
        x, y, z = np.concatenate(signal), np.concatenate(self.label), np.concatenate(control)
        keep = np.isfinite(x) & np.isfinite(y) & np.isfinite(z)
        owner = self.owner[keep]
        cx, cy, cz = (_rank_counts(v[keep], owner, n) for v in (x, y, z))
        xy, xz, yz = (_RankMoments(a, b, owner, n) for a, b in ((cx, cy), (cx, cz), (cy, cz)))
        lo, hi = self._interval(lambda m: partial_from_rhos(xy.rho(m), xz.rho(m), yz.rho(m)))
        return Correlation(rho, lo, hi, p, n, pairs)

    def _interval(self, rho_of_multiplicities) -> tuple[float, float]:
        """The 95% percentile interval of a statistic of per-sample multiplicities, over resamples of the
        samples that are the same for every call (one seed)."""
        n = len(self.label)

        def statistic(idx: np.ndarray, axis: int = -1) -> np.ndarray:
            idx = np.atleast_2d(idx)
            m = np.zeros((idx.shape[0], n))
            np.add.at(m, (np.arange(idx.shape[0])[:, None], idx), 1.0)
            return rho_of_multiplicities(m)

        # a few samples make resamples that repeat one sample: scipy warns and the interval is NaN, which the
        # summary says in words ("too few samples"); the warning itself would be noise
        with warnings.catch_warnings():
            for category in (stats.DegenerateDataWarning, stats.ConstantInputWarning, RuntimeWarning):
                warnings.simplefilter("ignore", category)
            res = stats.bootstrap(
                (np.arange(n),),
                statistic,
                vectorized=True,
                n_resamples=self.n_resamples,
                batch=100,
                method="percentile",
                rng=np.random.default_rng(self.seed),
            )
        lo, hi = res.confidence_interval
        return float(lo), float(hi)
