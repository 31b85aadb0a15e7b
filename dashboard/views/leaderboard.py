"""Leaderboard: methods x domains (and x tasks) at one budget."""

from __future__ import annotations

import math

import streamlit as st

from dashboard.views.common import INT, empty, pick_budget, styled

DETAIL_COLUMNS = {
    "rank": "rank", "method": "method", "domain": "domain", "accuracy": "accuracy %", "interval": "95% CI",
    "interval_method": "interval", "delta_full": "Δ vs full (pts)", "delta_ci": "Δ 95% CI", "p_value": "p",
    "test": "test", "evicted_share": "eviction fired %", "problems": "problems", "samples": "samples", "failed": "failed",
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
    return out.sort_values(["domain", "rank", "method"] if not with_task else ["domain", "task", "rank", "method"]).reset_index(drop=True)


CONFIG = {"rank": INT, "problems": INT, "samples": INT, "failed": INT}
DETAIL_FORMATS = {"pct": ("accuracy %", "eviction fired %"), "pp": ("Δ vs full (pts)",), "p": ("p",)}


def render(ctx) -> None:
    st.title("Leaderboard")
    budgets = list(ctx.filters.budgets or ctx.opts.budgets)
    budget = pick_budget("Budget", budgets, key="lb_budget")
    if budget is None:
        return
    lb = ctx.data("leaderboard", ctx.filters, budget)
    if lb.by_domain.empty:
        empty()
        return
    note = ""
    if lb.full_budget is None:
        note = " No full-cache results match the filters, so there is no difference column."
    elif lb.full_budget != budget:
        note = f" Full cache has no results at this budget; the reference is its run at budget {lb.full_budget:,}."
    st.caption(
        f"Accuracy (%) at a budget of {budget:,} KV entries, with 95% intervals: Wilson for one greedy sample per problem, "
        "else a bootstrap over problems. Δ vs full: method minus full cache on the problems both answered, in points, "
        "with a paired bootstrap interval and p from McNemar's exact test (one sample per problem) or the paired bootstrap "
        "(several). Rank: by mean accuracy over the domains shown (each domain weighs the same)." + note
    )
    wide = lb.wide
    st.subheader(f"Methods x domains at budget {budget:,}")
    st.dataframe(
        styled(wide, pct=["mean accuracy", "evicted %", *[f"{d} %" for d in lb.domains]], pp=[f"{d} Δ full" for d in lb.domains]),
        hide_index=True, placeholder="—", column_config=CONFIG, key="lb_wide",
    )

    st.subheader("Per method and domain")
    detail = _detail(lb.by_domain)
    st.dataframe(styled(detail, **DETAIL_FORMATS), hide_index=True, placeholder="—", column_config=CONFIG, key="lb_detail")
    st.download_button(
        "Download CSV", detail.to_csv(index=False).encode(), file_name=f"kvleague-leaderboard-budget{budget}.csv",
        mime="text/csv", key="lb_csv",
    )
    with st.expander("Per method and task"):
        by_task = _detail(lb.by_task, with_task=True)
        st.dataframe(styled(by_task, **DETAIL_FORMATS), hide_index=True, placeholder="—", column_config=CONFIG, key="lb_task")
        st.download_button(
            "Download CSV (tasks)", by_task.to_csv(index=False).encode(),
            file_name=f"kvleague-leaderboard-tasks-budget{budget}.csv", mime="text/csv", key="lb_task_csv",
        )
