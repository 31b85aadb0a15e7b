"""Head to head: every pair of methods at the leaderboard's budget, with exact paired tests."""

from __future__ import annotations

import streamlit as st

from kvleague.analysis import head_to_head as h2h
from kvleague.analysis import paper, verdicts
from kvleague.dashboard.views.common import INT, styled


def section(ctx, budget: int) -> None:
    many = len(ctx.opts.methods) > h2h.ALL_PAIRS_MAX
    involving = {"full", *paper.REFERENCE_FAMILY, *paper.PAPER_BASELINES} if many else None
    pairs = ctx.data(h2h.head_to_head, ctx.filters, budget, None, involving)
    if pairs.empty:
        return
    st.subheader(f"Head to head at budget {budget:,}")
    st.caption(
        "Each pair on the problems every method here has (a failed sample counts as wrong). **A only** / **B only**: "
        "problems one method answered and the other did not. **p** is the leaderboard's paired test: exact McNemar "
        "(two-sided binomial test of A only among the discordant problems at 1/2) below 25 discordant problems, else "
        f"the score test. **p (adj.)**, **Δ lo** / **Δ hi** and **verdict**: {verdicts.FAMILY_TEXT}; the same as on every "
        "page. Sorted by p."
        + (
            f" More than {h2h.ALL_PAIRS_MAX} methods: only the pairs with full cache or the paper's methods."
            if many
            else ""
        )
    )
    st.dataframe(
        styled(pairs, pct=["A %", "B %"], pp=["Δ A−B (pts)", "Δ lo", "Δ hi"], p=["p", "p (adj.)"]),
        hide_index=True,
        placeholder="—",
        column_config={c: INT for c in ("problems", "both right", "A only", "B only", "both wrong")},
        key="h2h",
    )
