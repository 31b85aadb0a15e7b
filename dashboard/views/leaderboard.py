"""Leaderboard: methods x domains (and x tasks) at one budget."""

from __future__ import annotations

import math

import streamlit as st

from kvleague.analysis import stats, tables, verdicts
from kvleague.analysis.paper import MARGINS
from kvleague.dashboard.views import fidelity, head_to_head
from kvleague.dashboard.views.common import INT, budget_text, empty, pick_budget, pick_weighting, styled

DETAIL_COLUMNS = {
    "rank": "rank",
    "vs_best": "vs best",
    "method": "method",
    "domain": "domain",
    "accuracy": "accuracy %",
    "interval": "95% CI",
    "interval_method": "interval",
    "delta_full": "Δ vs full (pts)",
    "delta_ci": f"Δ {verdicts.LEVEL_TEXT} CI",
    "p_value": "p",
    "test": "test",
    "verdict_full": "vs full",
    "evicted_share": "eviction fired %",
    "problems": "problems",
    "samples": "samples",
    "failed": "failed",
    "note": "note",
}


def _detail(df, with_task: bool = False):
    out = df.copy()
    out["delta_ci"] = [
        "-" if math.isnan(lo) else f"[{lo:+.1f}, {hi:+.1f}]" for lo, hi in zip(out["delta_lo"], out["delta_hi"])
    ]
    cols = list(DETAIL_COLUMNS)
    if with_task:
        cols.insert(3, "task")
    out = out[cols].rename(columns=DETAIL_COLUMNS)
    return out.sort_values(
        ["domain", "rank", "method"] if not with_task else ["domain", "task", "rank", "method"]
    ).reset_index(drop=True)


CONFIG = {"rank": INT, "problems": INT, "samples": INT, "failed": INT}
DETAIL_FORMATS = {"pct": ("accuracy %", "eviction fired %"), "pp": ("Δ vs full (pts)",), "p": ("p",)}


def render(ctx) -> None:
    st.title("Leaderboard")
    budget = pick_budget(ctx, "Budget", key="lb_budget")
    if budget is None:
        return
    weighting = pick_weighting("lb_weighting")
    lb = ctx.data(tables.leaderboard, ctx.filters, budget, None, weighting)
    if lb.by_domain.empty:
        if not fidelity.section(ctx, budget):  # a fidelity-only sweep has no accuracy to show
            empty()
        return
    note = ""
    if lb.full_budget is None:
        note = " No full-cache results match the filters, so there is no difference column."
    elif lb.full_budget != budget:
        note = f" Full cache has no results at this budget; the reference is its run at budget {lb.full_budget:,}."
    st.caption(
        f"Budget {budget_text(ctx, budget)}. **Problems**: each table uses only the problem cells (problem x model x protocol x "
        "generation setting) that *every* method in it has, so accuracy and rank rest on the same problems (Δ and the "
        "verdicts on the problems the two compared methods have, the same set when every method ran them all); **problems** "
        "is how many questions that is, **failed** how many of those samples raised: a failed sample counts as wrong. "
        "The unit is the question: its cells (models, seeds, settings) are averaged, never counted as separate problems. "
        f"Tasks are pooled per {weighting}. **Accuracy** (%): mean share correct, 95% Wilson score interval (with a design "
        "effect when a question has several samples or cells). **Δ vs full**: method minus full cache in points with the "
        "interval of its test; **p**: the same score test (McNemar's statistic without continuity correction for one sample "
        f"per question; exact McNemar below 25 discordant questions); the interval and the verdicts: {verdicts.FAMILY_TEXT}, "
        "so the interval excludes 0 exactly when the adjusted test rejects. "
        "**vs full** and **vs best** (the table's best by the point estimate) compare the two on the questions both have, "
        "the rule declared in analysis/paper.yaml, so adding a method never changes another's "
        f"verdict: higher / lower when the adjusted test rejects, *equivalent within ±{100 * MARGINS['accuracy']:g} pts* only when "
        "both one-sided tests at that margin reject, else *inconclusive* (not significant is not the same). "
        "**Rank**: by the point estimate. "
        f"Fewer than {stats.MIN_PROBLEMS} questions: the numbers are shown but the calibration (docs/statistics.md) does not "
        "hold. The wide table's mean weighs each domain the same." + note
    )
    wide = lb.wide
    st.subheader(f"Methods x domains at budget {budget:,}")
    st.dataframe(
        styled(
            wide,
            pct=["mean accuracy", "evicted %", *[f"{d} %" for d in lb.domains]],
            pp=[f"{d} Δ full" for d in lb.domains],
        ),
        hide_index=True,
        placeholder="—",
        column_config=CONFIG,
        key="lb_wide",
    )

    st.subheader("Per method and domain")
    detail = _detail(lb.by_domain)
    st.dataframe(
        styled(detail, **DETAIL_FORMATS), hide_index=True, placeholder="—", column_config=CONFIG, key="lb_detail"
    )
    st.download_button(
        "Download CSV",
        detail.to_csv(index=False).encode(),
        file_name=f"kvleague-leaderboard-budget{budget}.csv",
        mime="text/csv",
        key="lb_csv",
    )
    head_to_head.section(ctx, budget)
    fidelity.section(ctx, budget)
    with st.expander("Per method and task"):
        by_task = _detail(lb.by_task, with_task=True)
        st.dataframe(
            styled(by_task, **DETAIL_FORMATS), hide_index=True, placeholder="—", column_config=CONFIG, key="lb_task"
        )
        st.download_button(
            "Download CSV (tasks)",
            by_task.to_csv(index=False).encode(),
            file_name=f"kvleague-leaderboard-tasks-budget{budget}.csv",
            mime="text/csv",
            key="lb_task_csv",
        )
