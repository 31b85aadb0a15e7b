"""Adjusting a family of p-values for multiple comparisons: Holm's step-down method, which controls
the family-wise error rate under any dependence between the tests (the scorecard's claims share their
data). NaN entries (comparisons without a test) are left out of the family and stay NaN."""

from __future__ import annotations

import math
from collections.abc import Sequence


def _tested(pvalues: Sequence[float]) -> list[int]:
    """Indices of the real p-values, smallest first; ties broken by position, so the result does not
    depend on anything but the values and their order."""
    idx = [i for i, p in enumerate(pvalues) if p is not None and not math.isnan(p)]
    return sorted(idx, key=lambda i: (pvalues[i], i))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment: ``max over j <= i of min(1, (m - j) * p_(j))``."""
    out = [math.nan] * len(pvalues)
    order = _tested(pvalues)
    m = len(order)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out
