"""Fidelity to the full cache beside accuracy on the leaderboard: mean KL and top-1 agreement per method
and domain (and task) with bootstrap intervals, and paired differences between methods."""

from __future__ import annotations

import streamlit as st

from kvleague.analysis import fidelity_tables, verdicts
from kvleague.dashboard.views.common import INT, styled

BOARD_SHOWN = ["method", "domain", "KL", "KL 95% CI", "top-1 %", "top-1 95% CI", "ΔNLL", "samples", "tokens"]
KL_FORMAT = {"KL": "{:.4f}", "ΔNLL": "{:+.4f}", "Δ KL (A−B)": "{:+.4f}", "KL A": "{:.4f}", "KL B": "{:.4f}"}


def _formats(df):
    return styled(df, pct=("top-1 %",), pp=("Δ top-1 (pts)",), p=("p (Wilcoxon)", "p (adj.)"), formats=KL_FORMAT)


def section(ctx, budget: int) -> bool:
    """The fidelity tables at ``budget``; False when there are no fidelity results there."""
    board = ctx.data(fidelity_tables.fidelity_board, ctx.filters, budget)
    if board.by_domain.empty:
        return False
    st.subheader(f"Fidelity to the full cache at budget {budget:,}")
    note = ""
    if board.full_budget is not None and board.full_budget != budget:
        note = f" Full cache (the same at every budget) is its measurement at budget {board.full_budget:,}."
    st.caption(
        "Teacher-forced on each task's reference continuation (runner/fidelity.py): per sample, the mean over its scored "
        "tokens of **KL**(full cache || method) in nats and of **top-1** agreement (the method's most likely next token "
        "is the full cache's); **ΔNLL**: the change in the reference token's negative log-likelihood. Means over samples "
        "(the unit; a sample's cells averaged), 95% bootstrap intervals over samples (2,000 resamples; BCa below 30 "
        "samples), descriptive. Each "
        "table uses the samples every method in it has. Lowest KL first." + note
    )
    st.dataframe(
        _formats(board.by_domain[BOARD_SHOWN]),
        hide_index=True,
        placeholder="—",
        column_config={"samples": INT, "tokens": INT},
        key="fid_domain",
    )
    pairs = ctx.data(fidelity_tables.fidelity_pairs, ctx.filters, budget)
    if not pairs.empty:
        st.markdown("**Paired differences between methods**")
        st.caption(
            "Each pair on the samples the two have, per domain (**runs**: the sweep runs whose rows it reads, a "
            "resume a run of its own; more than one where its sides were computed apart): mean difference A − B of "
            "per-sample KL (descriptive) "
            "and of top-1 agreement (95% bootstrap interval); **tied**: samples whose KLs differ by float32 rounding "
            "only, left out of **p (Wilcoxon)**, the two-sided signed-rank test of the KL differences, whose direction "
            "is **signed ranks**; **HL shift**: the Hodges–Lehmann estimate with the interval inverting that test; "
            f"**p (adj.)** and **verdict**: {verdicts.FAMILY_TEXT} (equivalence only within a tested "
            f"±{verdicts.margin_text('kl')}); the same for the pair on every page."
        )
        st.dataframe(
            _formats(pairs.drop(columns=["Δ KL lo", "Δ KL hi", "sign"])),
            hide_index=True,
            placeholder="—",
            column_config={"samples": INT, "runs": INT},
            key="fid_pairs",
        )
    with st.expander("Fidelity per method and task"):
        st.dataframe(
            _formats(board.by_task[["method", "domain", "task", *BOARD_SHOWN[2:]]]),
            hide_index=True,
            placeholder="—",
            column_config={"samples": INT, "tokens": INT},
            key="fid_task",
        )
    return True
