"""Every pair of methods at one budget, compared on the problems both have: the 2x2 table of one
greedy sample per problem and exact McNemar, the test a reviewer expects between two eviction methods.

For each pair (A, B) the common set is the problem cells both methods have (a failed sample counts as
wrong, as on the leaderboard). When every cell holds one sample and every question one cell, the
pair is a 2x2 table: ``A only`` (A right, B wrong) and ``B only`` are the discordant counts and the
p-value is the exact two-sided binomial test of ``A only`` among the discordant pairs at 1/2
(``scipy.stats.binomtest``), i.e. exact McNemar. Otherwise (several samples, models or settings per
question) the test is the leaderboard's paired score test on question means (:mod:`dashboard.stats`).
Holm's adjustment runs over all pairs shown at the budget.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pandas as pd
from scipy.stats import binomtest

from dashboard import common_set as cs
from dashboard import multiplicity
from dashboard import queries as q
from dashboard.tables import budget_results, pct

COLUMNS = ["A", "B", "problems", "both right", "A only", "B only", "both wrong", "A %", "B %", "Δ A−B (pts)",
           "test", "p", "p (Holm)"]


def exact_mcnemar(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p: the binomial test of ``a_only`` of ``a_only + b_only`` at 1/2."""
    n = a_only + b_only
    return 1.0 if n == 0 else float(binomtest(a_only, n, 0.5).pvalue)


def pair_row(results: cs.Results, a: int, b: int, labels: dict[int, str]) -> dict[str, Any]:
    group = cs.common_set(results, [a, b])
    ra, rb = results[a], results[b]
    single = group.cells and len(group.questions) == len(group.cells) and all(
        ra[c][cs.M] == 1 and rb[c][cs.M] == 1 for c in group.cells)
    row: dict[str, Any] = {"A": labels.get(a, f"#{a}"), "B": labels.get(b, f"#{b}"), "problems": len(group.questions)}
    acc_a, acc_b = group.accuracy(a), group.accuracy(b)
    row.update({"A %": pct(acc_a.mean), "B %": pct(acc_b.mean), "Δ A−B (pts)": pct(acc_a.mean - acc_b.mean)})
    if single:
        right_a = {c for c in group.cells if ra[c][cs.K]}
        right_b = {c for c in group.cells if rb[c][cs.K]}
        a_only, b_only = len(right_a - right_b), len(right_b - right_a)
        both = len(right_a & right_b)
        row.update({"both right": both, "A only": a_only, "B only": b_only,
                    "both wrong": len(group.cells) - both - a_only - b_only,
                    "test": "exact McNemar", "p": exact_mcnemar(a_only, b_only)})
    else:
        c = group.compare(a, b)
        row.update({"both right": math.nan, "A only": math.nan, "B only": math.nan, "both wrong": math.nan,
                    "test": c.test, "p": c.pvalue})
    return row


def head_to_head(engine, filters: q.Filters, budget: int, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """One row per pair of methods at ``budget`` (full cache from its reference budget), most
    significant first; ``p (Holm)`` adjusts over all the pairs."""
    dims = dims or q.dimensions(engine)
    results, _, _ = budget_results(engine, filters, budget, dims)
    labels = {m: dims["methods"][m]["label"] for m in results if m in dims["methods"]}
    methods = sorted(results, key=lambda m: (labels.get(m, ""), m))
    rows = [pair_row(results, a, b, labels) for a, b in itertools.combinations(methods, 2)]
    if not rows:
        return pd.DataFrame(columns=COLUMNS)
    for r, adjusted in zip(rows, multiplicity.holm([r["p"] for r in rows])):
        r["p (Holm)"] = adjusted
    df = pd.DataFrame(rows)[COLUMNS]
    return df.sort_values(["p", "A", "B"], kind="stable").reset_index(drop=True)
