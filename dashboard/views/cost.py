"""Cost: throughput, latency, memory and method overhead per method and budget on one slice (model x
protocol x generation setting); accuracy vs memory where the memory differs; the stored systems
benchmarks (``kvleague bench ... --store``)."""

from __future__ import annotations

import altair as alt
import streamlit as st

from kvleague.analysis import queries as q
from kvleague.analysis import tables
from kvleague.dashboard.views.common import (
    PCT,
    empty,
    height_with_legend,
    method_colour,
    method_shape,
    pick_slice,
)

#: the tables the page shows, each beside method and budget (the CSV has every column)
TABLES = {
    "speed": ["samples", "tokens/s", "tokens/s lo", "tokens/s hi", "ms/token", "ms/token p95", "prefill s"],
    "memory": [
        "peak KV MiB",
        "peak KV MiB (max)",
        "peak memory MiB (max)",
        "peak cache entries",
        "accuracy",
        "acc_lo",
        "acc_hi",
    ],
    "overhead": ["method ms/sample", "selection ms/sample", "method overhead %", "overhead lo", "overhead hi"],
}
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
    setup(ctx, filters)
    st.caption(
        "Means over ok samples per method and budget, with 95% t intervals over samples (tokens/s) and of the "
        "ratio of sums (method overhead: time in the eviction method as a share of prefill + decode time). "
        "ms/token: mean decode step; peak KV: bytes of keys and values held at the peak. accuracy: on the "
        "method's own problems at that budget (not a common set: this page compares cost, not accuracy), failed "
        "samples counted as wrong, questions as the unit, 95% Wilson score interval."
    )
    num = {c: st.column_config.NumberColumn(format="%.2f") for c in df.columns if df[c].dtype.kind == "f"}
    num.update({"accuracy": PCT, "acc_lo": PCT, "acc_hi": PCT})
    # three tables of at most ten columns, each fits the page's width (one of eighteen was cut at the right)
    for name, columns in TABLES.items():
        st.dataframe(
            df[["method", "budget", *columns]],
            hide_index=True,
            placeholder="—",
            column_config=num,
            key=f"cost_{name}",
            width="stretch",
        )
    st.download_button(
        "Download CSV", df.to_csv(index=False).encode(), file_name="kvleague-cost.csv", mime="text/csv", key="cost_csv"
    )
    budgets = sorted(df["budget"].unique().tolist())
    x = alt.X(
        "budget:Q", scale=alt.Scale(type="log", base=2), axis=alt.Axis(values=budgets, format="~s"), title="budget"
    )
    colour, shape = method_colour(df["method"]), method_shape(df["method"])
    height = height_with_legend(280, df["method"])
    detail = [alt.Detail(f"{c}:N") for c in q.SLICE_COLUMNS]

    def with_error_bars(y: str, lo: str, hi: str, title: str, tooltip: list[str]) -> alt.LayerChart | alt.FacetChart:
        base = alt.Chart(df).encode(x=x, color=colour, detail=detail)
        line = base.mark_line(point=alt.OverlayMarkDef(filled=True, size=60)).encode(
            y=alt.Y(f"{y}:Q"),
            shape=shape,
            tooltip=[*tooltip, alt.Tooltip(f"{lo}:Q", format=".2f"), alt.Tooltip(f"{hi}:Q", format=".2f")],
        )
        bars = base.mark_errorbar(ticks=True).encode(y=alt.Y(f"{lo}:Q", title=y), y2=f"{hi}:Q")
        return (bars + line).properties(title=title, height=height)

    c1, c2 = st.columns(2)
    with c1:
        st.altair_chart(
            with_error_bars(
                "tokens/s",
                "tokens/s lo",
                "tokens/s hi",
                "decoding throughput",
                ["method", "budget", "tokens/s", "ms/token"],
            ),
            width="stretch",
        )
    with c2:
        st.altair_chart(
            with_error_bars(
                "method overhead %",
                "overhead lo",
                "overhead hi",
                "method overhead (% of model time)",
                ["method", "budget", "method overhead %", "method ms/sample"],
            ),
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
            shape=shape,
            opacity=alt.condition("datum.pareto", alt.value(1.0), alt.value(0.35)),
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


def setup_lines(rows: list[dict]) -> list[str]:
    """One line per set-up the slice's timings were taken under (the rows of ``queries.cost_setup``):
    the machine, backend, attention kernel, cells decoded together, and the sweep's workers and threads,
    which set the load (workers share the machine's cores)."""
    lines = []
    for r in sorted(rows, key=lambda r: (r["sweep_id"], str(r["backend"]), r["batch"] or 0)):
        res = r["resources"]
        machine = r["hostname"] or "an unrecorded machine"
        device = f"GPU {r['gpu_name']}" if r["gpu_name"] and r["gpu_name"] != "none" else "CPU"
        load = (
            f"{res.get('workers') or 'auto'} workers x {res.get('cpus_per_worker', '?')} CPUs, "
            f"{res.get('torch_threads', '?')} torch threads each"
        )
        lines.append(
            f"sweep #{r['sweep_id']}: {r['rows']} rows on {machine} ({device}), backend {r['backend'] or 'hf'}, "
            f"{r['attn_implementation'] or '?'} attention, "
            + (f"{r['batch']} cells decoded together; " if (r["batch"] or 1) > 1 else "one cell at a time; ")
            + f"{r['workers']} worker processes, configured {load}"
        )
    return lines


def setup(ctx, filters) -> None:
    lines = setup_lines(ctx.data(q.cost_setup, filters))
    if lines:
        st.caption("Timings taken under (they depend on all of it: compare points measured under one set-up)")
        st.text("\n".join(lines))  # hostnames come from the database: plain text, never markdown


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
