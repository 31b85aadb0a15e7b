"""Formatting shared by the pages."""

from __future__ import annotations

import pandas as pd
import streamlit as st

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


def _num(fmt: str):
    return lambda v: DASH if v is None or pd.isna(v) else fmt.format(v)


def fmt_p(v) -> str:
    """Two significant digits: the score tests' normal approximation does not resolve more, and
    "<0.001" is all a reader needs below that."""
    if v is None or pd.isna(v):
        return DASH
    return "<0.001" if v < 1e-3 else f"{v:.2g}" if v < 0.1 else f"{v:.2f}" if v < 0.995 else "1"


def styled(df: pd.DataFrame, pct=(), pp=(), p=(), verdicts: bool = True):
    """Display formats (missing values as a dash) on a Styler: the values underneath stay numbers, so
    sorting by a column sorts numerically and the CSV export keeps full precision."""
    sty = df.style
    fmt = {}
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
    cols = [c for c in df.columns if c.startswith("verdict")] if verdicts else []
    if cols:
        sty = sty.map(lambda v: VERDICT_COLOURS.get(v, "color: #666" if str(v).startswith("too few") else ""), subset=cols)
    return sty


def style_verdicts(df: pd.DataFrame):
    return styled(df)


WEIGHTING_HELP = ("How questions of several tasks are pooled into one number: per problem (each question weighs the "
                  "same, so math500's 500 questions outweigh aime24's 30) or per task (each task weighs the same).")


def pick_weighting(key: str) -> str:
    return st.radio("Pool tasks", ("problem", "task"), horizontal=True, key=key, help=WEIGHTING_HELP,
                    format_func=lambda w: f"per {w}")


def pick_budget(label: str, budgets: list[int], key: str) -> int | None:
    if not budgets:
        st.info("No budget is selected in the filters.")
        return None
    return st.selectbox(label, budgets, index=len(budgets) // 2, key=key, format_func=lambda b: f"{b:,} KV entries")


def empty(message: str = "No results match the filters.") -> None:
    st.info(message)
