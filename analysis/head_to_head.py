"""Every pair of methods at one budget, compared on the table's problems: the 2x2 table of one greedy
sample per problem and the leaderboard's paired test, the comparison a reviewer expects between two
eviction methods.

The common set is the problem cells every method in the table has (a failed sample counts as wrong, as
on the leaderboard, whose domain table uses the same set), so every row, and a sentence citing it, rests
on the same problems; a prompt two task rows share counts once (:mod:`analysis.identity`). When every
cell holds one sample and every question one cell, the pair is a 2x2 table: ``A only`` (A right, B
wrong) and ``B only`` are the discordant counts. The p-value is always the leaderboard's
(:func:`analysis.stats.compare`): exact McNemar (the two-sided binomial test of ``A only`` among the
discordant pairs at 1/2) below 25 discordant pairs, McNemar's score test above; with several samples,
models or settings per question the score test on question means. Holm's adjustment runs over all
pairs shown at the budget.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pandas as pd

from kvleague.analysis import common_set as cs
from kvleague.analysis import identity, multiplicity
from kvleague.analysis import queries as q
from kvleague.analysis.tables import budget_results, pct

COLUMNS = [
    "A",
    "B",
    "problems",
    "both right",
    "A only",
    "B only",
    "both wrong",
    "A %",
    "B %",
    "Δ A−B (pts)",
    "Δ lo",
    "Δ hi",
    "test",
    "p",
    "p (Holm)",
]


def pair_row(group: cs.CommonSet, a: int, b: int, labels: dict[int, str]) -> dict[str, Any]:
    """A against B on ``group``'s cells."""
    ra, rb = group.results[a], group.results[b]
    single = (
        group.cells
        and len(group.questions) == len(group.cells)
        and all(ra[c][cs.M] == 1 and rb[c][cs.M] == 1 for c in group.cells)
    )
    row: dict[str, Any] = {"A": labels.get(a, f"#{a}"), "B": labels.get(b, f"#{b}"), "problems": len(group.questions)}
    acc_a, acc_b = group.accuracy(a), group.accuracy(b)
    c = group.compare(a, b)
    row.update(
        {
            "A %": pct(acc_a.mean),
            "B %": pct(acc_b.mean),
            "Δ A−B (pts)": pct(acc_a.mean - acc_b.mean),
            "Δ lo": pct(c.lo),
            "Δ hi": pct(c.hi),
            "test": c.test,
            "p": c.pvalue,
        }
    )
    if single:
        right_a = {c for c in group.cells if ra[c][cs.K]}
        right_b = {c for c in group.cells if rb[c][cs.K]}
        a_only, b_only = len(right_a - right_b), len(right_b - right_a)
        both = len(right_a & right_b)
        row.update(
            {
                "both right": both,
                "A only": a_only,
                "B only": b_only,
                "both wrong": len(group.cells) - both - a_only - b_only,
            }
        )
    else:
        row.update({"both right": math.nan, "A only": math.nan, "B only": math.nan, "both wrong": math.nan})
    return row


def head_to_head(engine, filters: q.Filters, budget: int, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """One row per pair of methods at ``budget`` (full cache from its reference budget) on the cells every
    method has, most significant first; ``p (Holm)`` adjusts over all the pairs. ``Δ lo`` / ``Δ hi``: the
    interval that goes with the test (points)."""
    dims = dims or q.dimensions(engine)
    results = identity.pool(budget_results(engine, filters, budget, dims)[0], dims["tasks"])
    labels = {m: dims["methods"][m]["label"] for m in results if m in dims["methods"]}
    methods = sorted(results, key=lambda m: (labels.get(m, ""), m))
    group = cs.common_set(results, methods)
    rows = [pair_row(group, a, b, labels) for a, b in itertools.combinations(methods, 2)]
    if not rows:
        return pd.DataFrame(columns=COLUMNS)
    for r, adjusted in zip(rows, multiplicity.holm([r["p"] for r in rows])):
        r["p (Holm)"] = adjusted
    df = pd.DataFrame(rows)[COLUMNS]
    return df.sort_values(["p", "A", "B"], kind="stable").reset_index(drop=True)
