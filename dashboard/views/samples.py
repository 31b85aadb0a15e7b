"""Samples: one problem across methods, side by side - to see how a method fails."""

from __future__ import annotations

import streamlit as st

from kvleague.analysis import queries as q
from kvleague.analysis import tables
from kvleague.dashboard.views.common import budget_text, empty, most_data, plain

MARK = {True: "correct", False: "wrong", None: "-"}


def render(ctx) -> None:
    st.title("Samples")
    tasks = [t for t in ctx.opts.tasks if ctx.filters.tasks is None or t["id"] in ctx.filters.tasks]
    if not tasks:
        empty()
        return
    names = {t["id"]: t["label"] for t in tasks}
    # open on the task, then the budget, with the most generations (fidelity rows have no completion)
    counts = ctx.data(q.row_counts, ctx.filters, ("task_id", "budget"))
    per_task: dict[tuple, int] = {}
    for (task, _), n in counts.items():
        per_task[(task,)] = per_task.get((task,), 0) + n
    c1, c2, c3 = st.columns([2, 2, 1])
    with c1:
        task_id = st.selectbox(
            "Task",
            list(names),
            index=most_data(per_task, list(names)),
            format_func=lambda i: names[i],
            key="sm_task",
            help="Opens on the task with the most generations.",
        )
    budgets = list(ctx.filters.budgets or ctx.opts.budgets)
    if not budgets:
        empty("No budget is selected in the filters.")
        return
    with c2:
        budget = st.selectbox(
            "Budget",
            budgets,
            index=most_data(counts, [(task_id, b) for b in budgets]),
            key="sm_budget",
            format_func=lambda b: budget_text(ctx, b),
            help="Opens on the task's budget with the most generations.",
        )
    with c3:
        disagree = st.checkbox("only problems where methods disagree", value=False, key="sm_disagree")
    ids = ctx.data(q.problem_ids, ctx.filters, task_id, budget, disagree)
    if not ids:
        empty("No problems match.")
        return
    sample_id = st.selectbox(f"Problem ({len(ids)})", ids, key="sm_problem")
    df = ctx.data(tables.samples, ctx.filters, task_id, sample_id, budget)
    if df.empty:
        empty()
        return
    st.caption(
        "flag: failed (the cell raised), empty (no text), loop (most 4-grams repeat), truncated (hit the token limit)."
    )
    st.dataframe(df.drop(columns=["completion", "error"]), hide_index=True, placeholder="—", key="sm_table")
    per_row = 3
    records = df.to_dict("records")
    for start in range(0, len(records), per_row):
        cols = st.columns(per_row)
        for col, r in zip(cols, records[start : start + per_row]):
            with col:
                tag = MARK.get(r["correct"] if r["correct"] in (True, False) else None, "-")
                extra = (
                    f" · sample {r['sample_index']}, seed {r['seed']}"
                    if df["sample_index"].nunique() > 1 or df["seed"].nunique() > 1
                    else ""
                )
                flag = f" · :red[{r['flag']}]" if r["flag"] else ""
                st.markdown(f"**{plain(r['method'])}** · {tag}{extra}{flag}")
                # what the model wrote is text, never markdown (an image link would make the browser fetch it)
                st.text(f"extracted: {r['extracted']!s}")
                st.caption(
                    f"{r['generated_tokens']} tokens · {r['evictions']} evictions ({r['evicted_tokens']} tokens evicted)"
                )
                if r["status"] != "ok":
                    st.code(str(r["error"]), language=None, wrap_lines=True)
                else:
                    st.code(r["completion"] or "(empty)", language=None, wrap_lines=True, height=260)
