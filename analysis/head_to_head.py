"""Every pair of methods at one budget, compared on the table's problems: the 2x2 table of one greedy
sample per problem and the leaderboard's paired test, the comparison a reviewer expects between two
eviction methods.

Each pair is compared on the problem cells the two have (a failed sample counts as wrong), as the
leaderboard and the scorecard compare it, so a pair has one verdict everywhere and does not move when
another method joins; a prompt two task rows share counts once (:mod:`analysis.identity`). When every
cell holds one sample and every question one cell, the pair is a 2x2 table: ``A only`` (A right, B
wrong) and ``B only`` are the discordant counts. The p-value is always the leaderboard's
(:func:`analysis.stats.compare`): exact McNemar (the two-sided binomial test of ``A only`` among the
discordant pairs at 1/2) below 25 discordant pairs, McNemar's score test above; with several samples,
models or settings per question the score test on question means. p (adj.), the interval and the verdict
come from :func:`analysis.verdicts.judge` (Bonferroni over the pair's declared domains).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pandas as pd

from kvleague.analysis import common_set as cs
from kvleague.analysis import identity
from kvleague.analysis import queries as q
from kvleague.analysis.tables import Slice, budget_results, pair_verdict, pct

#: above this many methods the page shows only the pairs with full cache or the paper's methods
ALL_PAIRS_MAX = 30

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
    "p (adj.)",
    "verdict",
]


def pair_row(s: Slice, a: int, b: int, labels: dict[int, str]) -> dict[str, Any]:
    """A against B on the cells the two have in ``s``."""
    group = s.group([a, b])
    ra, rb = group.results[a], group.results[b]
    single = (
        group.cells
        and len(group.questions) == len(group.cells)
        and all(ra[c][cs.M] == 1 and rb[c][cs.M] == 1 for c in group.cells)
    )
    row: dict[str, Any] = {"A": labels.get(a, f"#{a}"), "B": labels.get(b, f"#{b}"), "problems": len(group.questions)}
    acc_a, acc_b = group.accuracy(a), group.accuracy(b)
    v = pair_verdict(s, a, b, ("A higher", "B higher"))
    row.update(
        {
            "A %": pct(acc_a.mean),
            "B %": pct(acc_b.mean),
            "Δ A−B (pts)": pct(acc_a.mean - acc_b.mean),
            "Δ lo": pct(v.lo),
            "Δ hi": pct(v.hi),
            "test": v.test,
            "p": v.p,
            "p (adj.)": v.p_adjusted,
            "verdict": v.word,
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


def head_to_head(
    engine, filters: q.Filters, budget: int, dims: dict[str, Any] | None = None, involving: set[str] | None = None
) -> pd.DataFrame:
    """One row per pair of methods at ``budget`` (full cache from its reference budget), most significant
    first; ``involving``: only pairs with a method of these names (the page's rule beyond
    :data:`ALL_PAIRS_MAX` methods: all pairs grow as the square). ``Δ lo`` / ``Δ hi``: the interval that goes
    with the adjusted test (points)."""
    dims = dims or q.dimensions(engine)
    results = identity.pool(budget_results(engine, filters, budget, dims)[0], dims["tasks"])
    labels = {m: dims["methods"][m]["label"] for m in results if m in dims["methods"]}
    methods = sorted(results, key=lambda m: (labels.get(m, ""), m))
    s = Slice(results, None)
    name = lambda m: dims["methods"].get(m, {}).get("name")  # noqa: E731
    pairs = [
        (a, b) for a, b in itertools.combinations(methods, 2) if involving is None or {name(a), name(b)} & involving
    ]
    rows = [pair_row(s, a, b, labels) for a, b in pairs]
    if not rows:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.DataFrame(rows)[COLUMNS]
    return df.sort_values(["p", "A", "B"], kind="stable").reset_index(drop=True)
