"""Formatting shared by the pages."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from kvleague.analysis import queries as q

PCT = st.column_config.NumberColumn(format="%.1f")
PP = st.column_config.NumberColumn(format="%+.1f")
INT = st.column_config.NumberColumn(format="%d")

VERDICT_COLOURS = {
    "replicates": "background-color: #d8f3dc; color: #1b4332",
    "does not replicate": "background-color: #ffd6d6; color: #7f1d1d",
    "inconclusive": "background-color: #fff3c4; color: #5c4400",
    "consistent with the paper": "background-color: #d8f3dc; color: #1b4332",
    "differs from the paper": "background-color: #ffd6d6; color: #7f1d1d",
}


DASH = "—"

#: CommonMark lets a backslash make any ASCII punctuation literal; these are the ones markdown, HTML,
#: Streamlit's directives (``:red[...]``) and its LaTeX (``$``) give a meaning to
_MARKUP = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~$:&=^])")


def plain(text: object) -> str:
    """``text`` (a name, a label, a message: anything a model, a task file or an import wrote) made safe
    to place inside markdown: shown as written, never rendered as an image, a link, HTML or a
    directive. Free text (a completion) goes to ``st.text``/``st.code`` instead."""
    return _MARKUP.sub(r"\\\1", str(text)).replace("\n", " ")


def _num(fmt: str):
    return lambda v: DASH if v is None or pd.isna(v) else fmt.format(v)


def fmt_p(v) -> str:
    """Two significant digits: the score tests' normal approximation does not resolve more, and
    "<0.001" is all a reader needs below that."""
    if v is None or pd.isna(v):
        return DASH
    return "<0.001" if v < 1e-3 else f"{v:.2g}" if v < 0.1 else f"{v:.2f}" if v < 0.995 else "1"


def styled(df: pd.DataFrame, pct=(), pp=(), p=(), formats: dict[str, str] | None = None, verdicts: bool = True):
    """Display formats (missing values as a dash) on a Styler: the values underneath stay numbers, so
    sorting by a column sorts numerically and the CSV export keeps full precision. ``formats``: other
    columns' format strings. All in one ``Styler.format`` call: a later call gives every column it does
    not name the default six decimals again."""
    sty = df.style
    fmt: dict[Any, Any] = {c: _num(f) for c, f in (formats or {}).items() if c in df.columns}
    for c in pct:
        if c in df.columns:
            fmt[c] = _num("{:.1f}")
    for c in pp:
        if c in df.columns:
            fmt[c] = _num("{:+.1f}")
    for c in p:
        if c in df.columns:
            fmt[c] = fmt_p
    if fmt:
        sty = sty.format(fmt)
    cols: list[Any] = [c for c in df.columns if c.startswith("verdict")] if verdicts else []
    if cols:
        sty = sty.map(
            lambda v: VERDICT_COLOURS.get(str(v), "color: #666" if str(v).startswith("too few") else ""), subset=cols
        )
    return sty


def style_verdicts(df: pd.DataFrame):
    return styled(df)


WEIGHTING_HELP = (
    "How questions of several tasks are pooled into one number: per problem (each question weighs the "
    "same, so math500's 500 questions outweigh aime24's 30) or per task (each task weighs the same)."
)


def pick_weighting(key: str) -> str:
    return st.radio(
        "Pool tasks",
        ("problem", "task"),
        horizontal=True,
        key=key,
        help=WEIGHTING_HELP,
        format_func=lambda w: f"per {w}",
    )


def most_data(counts: dict[tuple, int], among: list) -> int:
    """The index in ``among`` of the value with the most rows in ``counts`` (keyed by 1-tuples or tuples
    matching ``among``'s items); ties go to the first."""

    def rows(v):
        return counts.get(v if isinstance(v, tuple) else (v,), 0)

    return max(range(len(among)), key=lambda i: (rows(among[i]), -i)) if among else 0


def budget_text(ctx, budget: int) -> str:
    """``1,024 KV entries``, or ``prompt+64 KV entries`` where the results give the budget on top of the prompt."""
    return f"{ctx.opts.budget_labels.get(budget, f'{budget:,}')} KV entries"


def pick_budget(ctx, label: str, key: str) -> int | None:
    """A budget among the filters' ones, opening on the budget with the most generation results (a
    fidelity-only database: the most fidelity results)."""
    budgets = list(ctx.filters.budgets or ctx.opts.budgets)
    if not budgets:
        st.info("No budget is selected in the filters.")
        return None
    counts = ctx.data(q.row_counts, ctx.filters) or ctx.data(
        q.row_counts, replace(ctx.filters, measure=q.MEASURE_FIDELITY)
    )
    return st.selectbox(
        label,
        budgets,
        index=most_data(counts, budgets),
        key=key,
        format_func=lambda b: budget_text(ctx, b),
        help="Opens on the budget with the most results.",
    )


def empty(message: str = "No results match the filters.") -> None:
    st.info(message)


def pick_slice(ctx, key: str, measure: str = q.MEASURE_GENERATION) -> tuple[q.Filters, dict] | None:
    """The filters narrowed to one model x protocol x generation setting, for a page that draws lines
    across budgets (a line must not join different experiments): a choice when the filters leave
    several, opening on the one with the most results; None when they leave none."""
    options = ctx.data(q.slices, replace(ctx.filters, measure=measure))
    if not options:
        return None
    by_key = {(o["model_id"], o["protocol_id"], o["generation_id"]): o for o in options}
    if len(options) == 1:
        chosen = options[0]
        st.caption(f"Slice: {plain(chosen['label'])}.")
    else:
        picked = st.selectbox(
            "Slice (model · protocol · generation)",
            list(by_key),
            key=key,
            format_func=lambda k: f"{by_key[k]['label']} ({by_key[k]['rows']:,} results)",
            help="A line joins points of one model, protocol and generation setting only; the "
            "slice with the most results comes first.",
        )
        chosen = by_key[picked]
    return replace(q.in_slice(ctx.filters, chosen), measure=measure), chosen


def coinciding_note(ctx, filters: q.Filters) -> None:
    """Say which methods have identical results here: their lines lie on each other."""
    groups = ctx.data(q.identical_methods, filters)
    if not groups:
        return
    labels = {i: m["label"] for i, m in ctx.opts.methods.items()}
    what = "KL, top-1 and ΔNLL" if filters.measure == q.MEASURE_FIDELITY else "completions"
    named = plain("; ".join(" = ".join(labels.get(i, str(i)) for i in g) for g in groups))
    st.warning(f"Identical {what} on every sample here: {named}. Their lines and rows coincide: one hides the other.")


#: Tableau 10: seven hue families first (the demo's seven methods; tableau20's pairs gave two methods
#: a light and a dark blue), then pink, brown and grey, told from red, orange and teal by their markers
METHOD_COLOURS = (
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
)  # fmt: skip
#: markers, so that methods differ without colour too (and past ten methods, by the pair)
METHOD_SHAPES = (
    "circle",
    "square",
    "triangle-up",
    "diamond",
    "cross",
    "triangle-down",
    "triangle-left",
    "triangle-right",
)


def method_styles(methods) -> dict[str, tuple[str, str]]:
    """The one mapping every chart uses: method -> (colour, marker), by the method's place in the sorted
    names on the page; colour i mod 10 and marker i mod 8, so 40 methods before a pair repeats."""
    return {
        m: (METHOD_COLOURS[i % len(METHOD_COLOURS)], METHOD_SHAPES[i % len(METHOD_SHAPES)])
        for i, m in enumerate(sorted(set(methods)))
    }


def _legend() -> alt.Legend:
    """Every method listed below the chart, in columns, full-strength (a layer of pale interval bands
    that uses this same legend does not make them pale); colour and marker share it."""
    return alt.Legend(
        orient="bottom", columns=LEGEND_COLUMNS, symbolLimit=0, symbolOpacity=1, symbolStrokeWidth=2, labelLimit=0
    )


def _method_scale(methods, which: int) -> dict[str, Any]:
    """A channel's encoding of each method's style (``which``: 0 its colour, 1 its marker), legend below."""
    styles = method_styles(methods)
    return {
        "scale": alt.Scale(domain=list(styles), range=[style[which] for style in styles.values()]),
        "legend": _legend(),
    }


def method_colour(methods, title: str = "method") -> alt.Color:
    """Each method's colour of :func:`method_styles`, with the legend below the chart."""
    return alt.Color("method:N", title=title, **_method_scale(methods, 0))


def method_shape(methods, title: str = "method") -> alt.Shape:
    """Each method's marker of :func:`method_styles`; with :func:`method_colour` one legend shows both."""
    return alt.Shape("method:N", title=title, **_method_scale(methods, 1))


#: legend columns under a chart half the page wide, and the height of one legend row
LEGEND_COLUMNS = 3
LEGEND_ROW_PX = 18


def height_with_legend(plot: int, methods) -> int:
    """The chart's height: Streamlit gives a chart exactly its height, legend included, so a legend
    of many rows would squeeze the plot (or be cut off) without its rows added."""
    rows = -(-len(set(methods)) // LEGEND_COLUMNS)
    return plot + 40 + rows * LEGEND_ROW_PX
