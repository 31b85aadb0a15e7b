"""Cost: throughput, latency, memory and method overhead per method and budget on one slice (model x
protocol x generation setting); accuracy vs memory where the memory differs; the stored systems
benchmarks (``kvleague bench ... --store``)."""

from __future__ import annotations

import altair as alt
import streamlit as st

from kvleague.analysis import queries as q
from kvleague.analysis import tables
from kvleague.dashboard.views.common import PCT, empty, height_with_legend, method_colour, pick_slice

#: below this spread of the mean peak KV memory (largest over smallest point) a memory axis shows nothing
MIN_MEMORY_SPREAD = 1.25


def render(ctx) -> None:
    st.title("Cost")
    sweep_costs(ctx)
    systems_benchmarks(ctx)


def sweep_costs(ctx) -> None:
    picked = pick_slice(ctx, "cost_slice")
    if picked is None:
        empty()
        return
    filters, chosen = picked
    df = ctx.data(tables.cost, filters)
    if df.empty:
        empty()
        return
    df = df.assign(**{c: chosen[c] for c in q.SLICE_COLUMNS})
    st.caption(
        "Means over ok samples per method and budget. ms/token: mean decode step; method overhead: time in the "
        "eviction method as a share of prefill + decode time; peak KV: bytes of keys and values held at the peak. "
        "accuracy: on the method's own problems at that budget (not a common set: this page compares cost, not "
        "accuracy), failed samples counted as wrong, questions as the unit, 95% Wilson score interval."
    )
    num = {c: st.column_config.NumberColumn(format="%.2f") for c in df.columns if df[c].dtype.kind == "f"}
    num.update({"accuracy": PCT, "acc_lo": PCT, "acc_hi": PCT})
    st.dataframe(df, hide_index=True, placeholder="—", column_config=num, key="cost_table")
    st.download_button(
        "Download CSV", df.to_csv(index=False).encode(), file_name="kvleague-cost.csv", mime="text/csv", key="cost_csv"
    )
    budgets = sorted(df["budget"].unique().tolist())
    x = alt.X(
        "budget:Q", scale=alt.Scale(type="log", base=2), axis=alt.Axis(values=budgets, format="~s"), title="budget"
    )
    colour = method_colour(df["method"])
    height = height_with_legend(280, df["method"])
    detail = [alt.Detail(f"{c}:N") for c in q.SLICE_COLUMNS]
    c1, c2 = st.columns(2)
    with c1:
        st.altair_chart(
            alt.Chart(df)
            .mark_line(point=True)
            .encode(
                x=x,
                y=alt.Y("tokens/s:Q"),
                color=colour,
                detail=detail,
                tooltip=["method", "budget", "tokens/s", "ms/token"],
            )
            .properties(title="decoding throughput", height=height),
            width="stretch",
        )
    with c2:
        st.altair_chart(
            alt.Chart(df)
            .mark_line(point=True)
            .encode(
                x=x,
                y=alt.Y("method overhead %:Q"),
                color=colour,
                detail=detail,
                tooltip=["method", "budget", "method overhead %", "method ms/sample"],
            )
            .properties(title="method overhead (% of model time)", height=height),
            width="stretch",
        )
    st.subheader("Accuracy vs peak KV memory")
    memory = df["peak KV MiB"].dropna()
    if memory.empty or memory.max() < MIN_MEMORY_SPREAD * memory.min():
        st.caption(
            f"Not drawn: every method and budget peaks at about {memory.mean():.1f} MiB of keys and values here, "
            "because the whole prompt is prefilled before the first eviction; a protocol with prefill_chunk bounds "
            "the peak by the budget. Accuracy against the budget: the Budget curves page."
        )
        return
    points = (
        alt.Chart(df)
        .mark_point(filled=True, size=80)
        .encode(
            x=alt.X("peak KV MiB:Q", scale=alt.Scale(type="log"), title="mean peak KV cache (MiB, log)"),
            y=alt.Y("accuracy:Q", title="accuracy %"),
            color=colour,
            shape=alt.Shape("pareto:N", title="Pareto front"),
            tooltip=[
                "method",
                "budget",
                alt.Tooltip("accuracy:Q", format=".1f"),
                alt.Tooltip("peak KV MiB:Q", format=".1f"),
                "pareto",
            ],
        )
    )
    front = (
        alt.Chart(df[df["pareto"]].sort_values("peak KV MiB"))
        .mark_line(color="#333", strokeDash=[4, 3])
        .encode(x="peak KV MiB:Q", y="accuracy:Q")
    )
    st.altair_chart((front + points).properties(height=height_with_legend(380, df["method"])), width="stretch")


def systems_benchmarks(ctx) -> None:
    st.subheader("Systems benchmarks")
    df = ctx.data(tables.systems_benchmarks)
    if df.empty:
        empty(
            "No systems benchmarks stored yet: run `kvleague bench context|speed|kvpress|generate --store --db URL`, "
            "or store a report saved with `--json`: `kvleague bench store REPORT.json --db URL`."
        )
        return
    st.caption(
        "The latest run of each benchmark (not affected by the filters; times in UTC). Ratios compare methods "
        "measured side by side in one run, on the machine shown; `kvleague bench context|speed|kvpress|generate --store` "
        "fills this table."
    )
    st.dataframe(df, hide_index=True, placeholder="—", key="systems_table")
    st.download_button(
        "Download CSV",
        df.to_csv(index=False).encode(),
        file_name="kvleague-systems-benchmarks.csv",
        mime="text/csv",
        key="systems_csv",
    )
