"""Head to head: every pair of methods at the leaderboard's budget, with exact paired tests."""

from __future__ import annotations

import streamlit as st

from kvleague.analysis import head_to_head as h2h
from kvleague.dashboard.views.common import INT, styled


def section(ctx, budget: int) -> None:
    pairs = ctx.data(h2h.head_to_head, ctx.filters, budget)
    if pairs.empty:
        return
    st.subheader(f"Head to head at budget {budget:,}")
    st.caption(
        "Each pair on the problems every method here has (a failed sample counts as wrong). **A only** / **B only**: "
        "problems one method answered and the other did not. **p** is the leaderboard's paired test: exact McNemar "
        "(two-sided binomial test of A only among the discordant problems at 1/2) below 25 discordant problems, else "
        "the score test; **Δ lo** / **Δ hi** its interval. **p (Holm)** adjusts over all pairs in this table. Sorted by p."
    )
    st.dataframe(
        styled(pairs, pct=["A %", "B %"], pp=["Δ A−B (pts)", "Δ lo", "Δ hi"], p=["p", "p (Holm)"]),
        hide_index=True,
        placeholder="—",
        column_config={c: INT for c in ("problems", "both right", "A only", "B only", "both wrong")},
        key="h2h",
    )
