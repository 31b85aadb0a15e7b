"""Budget curves: accuracy or fidelity vs budget per domain on one slice (model x protocol x
generation setting), one line per method, interval bands, full cache as a reference line."""

from __future__ import annotations

import altair as alt
import streamlit as st

from kvleague.analysis import fidelity_tables, tables
from kvleague.analysis import queries as q
from kvleague.dashboard.views.common import (
    PCT,
    coinciding_note,
    empty,
    height_with_legend,
    method_colour,
    method_shape,
    pick_slice,
    pick_weighting,
)

PLOT_HEIGHT = 320
SLICE_DETAIL = [alt.Detail(f"{c}:N") for c in q.SLICE_COLUMNS]


def _x(data) -> alt.X:
    if "compression_ratio" in data:  # ratio budgets (kvpress's protocol): score against the ratio, as kvpress plots it
        return alt.X(
            "compression_ratio:Q",
            title="compression ratio (share of the context evicted)",
            scale=alt.Scale(domain=[0, 1]),
        )
    budgets = sorted(data["budget"].unique().tolist())
    return alt.X(
        "budget:Q",
        title="budget (KV entries)",
        scale=alt.Scale(type="log", base=2),
        axis=alt.Axis(values=budgets, format="d", labelOverlap=False),
    )


def _base(data, methods) -> alt.Chart:
    """Lines grouped by method and by the slice columns: should two slices ever reach one chart, they
    draw two lines, never one that joins them."""
    return alt.Chart(data).encode(
        x=_x(data), color=method_colour(methods), shape=method_shape(methods), detail=SLICE_DETAIL
    )


def _band(data, methods) -> alt.Chart:
    return _base(data, methods).mark_area(opacity=0.12)


def with_slice(df, chosen: dict):
    return df.assign(**{c: chosen[c] for c in q.SLICE_COLUMNS})


def with_ratio(df, labels: dict):
    """``df`` with a ``compression_ratio`` column where every budget is a ratio (``budget_base: ratio``,
    stored in thousandths): the x axis then is the ratio."""
    if not df.empty and all(str(labels.get(b, "")).startswith("ratio ") for b in df["budget"].unique()):
        return df.assign(compression_ratio=df["budget"] / 1000)
    return df


def chart(curves, full, domain: str) -> alt.LayerChart | alt.FacetChart:
    data = curves[curves["domain"] == domain]
    base = _base(data, curves["method"])
    band = _band(data, curves["method"]).encode(y="acc_lo:Q", y2="acc_hi:Q")
    line = base.mark_line(point=True).encode(
        y=alt.Y("accuracy:Q", title="accuracy %"),
        tooltip=[
            "method",
            "budget",
            alt.Tooltip("accuracy:Q", format=".1f"),
            alt.Tooltip("acc_lo:Q", format=".1f"),
            alt.Tooltip("acc_hi:Q", format=".1f"),
            "problems",
            "interval_method",
        ],
    )
    layers = [band, line]
    ref = full[full["domain"] == domain]
    if not ref.empty:
        layers.append(
            alt.Chart(ref)
            .mark_rule(strokeDash=[6, 4], color="#444", size=2)
            .encode(y="accuracy:Q", tooltip=[alt.Tooltip("accuracy:Q", title="full cache %", format=".1f"), "problems"])
        )
        layers.append(
            alt.Chart(ref)
            .mark_text(align="left", dx=4, dy=-7, color="#444")
            .encode(y="accuracy:Q", x=alt.value(0), text=alt.value("full cache"))
        )
    return alt.layer(*layers).properties(title=domain, height=height_with_legend(PLOT_HEIGHT, curves["method"]))


#: what a fidelity curve plots: (column, its interval's columns, axis title)
FIDELITY_MEASURES = {
    "KL to full cache": ("KL", "KL lo", "KL hi", "mean KL(full || method), nats/token"),
    "top-1 agreement": ("top-1 %", "top-1 lo", "top-1 hi", "top-1 agreement with full cache %"),
}


def fidelity_chart(curves, domain: str, measure: str) -> alt.LayerChart | alt.FacetChart:
    y, lo, hi, title = FIDELITY_MEASURES[measure]
    data = curves[curves["domain"] == domain]
    base = _base(data, curves["method"])
    band = _band(data, curves["method"]).encode(y=f"{lo}:Q", y2=f"{hi}:Q")
    line = base.mark_line(point=True).encode(
        y=alt.Y(f"{y}:Q", title=title),
        tooltip=[
            "method",
            "budget",
            alt.Tooltip(f"{y}:Q", format=".4f"),
            alt.Tooltip(f"{lo}:Q", format=".4f"),
            alt.Tooltip(f"{hi}:Q", format=".4f"),
            "samples",
        ],
    )
    return alt.layer(band, line).properties(title=domain, height=height_with_legend(PLOT_HEIGHT, curves["method"]))


def coincident_note(curves, value: str) -> None:
    """Lines that coincide on the chart (the same plotted values), whether or not their samples are identical."""
    found = tables.coincident_lines(curves, value)
    if found:
        named = "; ".join(f"{d}: {' = '.join(ms)}" for d, ms in found)
        st.warning(
            f"Lines drawn on top of each other (the same {value} at every budget): {named}. One hides the others."
        )


def render(ctx) -> None:
    st.title("Budget curves")
    measure = st.radio(
        "Plot",
        ("accuracy", *FIDELITY_MEASURES),
        horizontal=True,
        key="bc_measure",
        help="accuracy of the generations, or fidelity to the full cache (teacher-forced, runner/fidelity.py)",
    )
    if measure != "accuracy":
        render_fidelity(ctx, measure)
        return
    weighting = pick_weighting("bc_weighting")
    picked = pick_slice(ctx, "bc_slice")
    if picked is None:
        empty()
        return
    filters, chosen = picked
    curves, full = ctx.data(tables.budget_curves, filters, None, weighting)
    if curves.empty:
        empty()
        return
    curves = with_ratio(with_slice(curves, chosen), ctx.opts.budget_labels)
    coinciding_note(ctx, filters)
    coincident_note(curves, "accuracy")
    st.caption(
        "Accuracy (%) against the KV budget (log scale), with 95% Wilson score bands (design effect when a question "
        "has several samples or cells); failed samples count as wrong. At each budget the methods of a domain share "
        f"the problem cells all of them have; tasks are pooled per {weighting}. The dashed line is full cache on its "
        "own problems at the budget where it has the most samples."
    )
    domains = sorted(curves["domain"].unique())
    cols = st.columns(2)
    for i, d in enumerate(domains):
        with cols[i % 2]:
            st.altair_chart(chart(curves, full, d), width="stretch")
    with st.expander("Data"):
        st.dataframe(
            curves, hide_index=True, placeholder="—", column_config={"accuracy": PCT, "acc_lo": PCT, "acc_hi": PCT}
        )
        st.dataframe(full.rename(columns={"accuracy": "full cache %"}), hide_index=True, placeholder="—")


def render_fidelity(ctx, measure: str) -> None:
    none = "No fidelity results match the filters (a sweep task entry with measure: fidelity writes them)."
    picked = pick_slice(ctx, "bc_fidelity_slice", q.MEASURE_FIDELITY)
    if picked is None:
        empty(none)
        return
    filters, chosen = picked
    curves = ctx.data(fidelity_tables.fidelity_curves, filters)
    if curves.empty:
        empty(none)
        return
    curves = with_slice(curves, chosen)
    coinciding_note(ctx, filters)
    coincident_note(curves, FIDELITY_MEASURES[measure][0])
    st.caption(
        f"{measure.capitalize()} against the KV budget (log scale), per domain: the mean over samples of each "
        "sample's mean over its scored tokens, with 95% percentile bootstrap bands over samples. At each budget the "
        "methods of a domain share the samples all of them have. Full cache is left out: its KL is 0 and its "
        "top-1 agreement 100% by construction."
    )
    cols = st.columns(2)
    for i, d in enumerate(sorted(curves["domain"].unique())):
        with cols[i % 2]:
            st.altair_chart(fidelity_chart(curves, d, measure), width="stretch")
    with st.expander("Data"):
        st.dataframe(curves, hide_index=True, placeholder="—", key="bc_fidelity_data")
