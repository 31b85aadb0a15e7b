"""Signals: which per-token signals predict occlusion importance (``kvleague signals``, issue 21). Rho of
the smoothed hidden-state change against layer depth per domain, with the paper's bands and the
authors' published figures; each method's own score per domain; the all-layer signals; each raw or with
the token's position held fixed."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from kvleague.analysis import signal_tables as sig
from kvleague.analysis.paper import (
    N_LAYERS,
    NEGATIVE_BAND,
    NEGATIVE_LAYERS,
    POSITIVE_BAND,
    POSITIVE_LAYERS,
    SOURCE_COMMIT,
    SOURCE_REPOSITORY,
)
from kvleague.dashboard.data import engine_for
from kvleague.dashboard.views.common import INT

RHO = st.column_config.NumberColumn(format="%+.3f")
RHOS = {c: RHO for c in ("rho", "rho_lo", "rho_hi", "partial_rho", "partial_lo", "partial_hi")}


@st.cache_data(show_spinner=False, ttl=3)
def _rows(url: str) -> pd.DataFrame:
    return sig.read_correlations(engine_for(url))


def depth_chart(depth: pd.DataFrame, reference: pd.DataFrame) -> alt.LayerChart | alt.FacetChart:
    """One line per domain (with its interval band), the authors' series dashed, the paper's bands shaded."""
    bands = pd.DataFrame(
        [
            {
                "from": POSITIVE_BAND[0],
                "to": POSITIVE_BAND[1],
                "band": f"paper: positive band (layers {POSITIVE_LAYERS[0]}-{POSITIVE_LAYERS[1]} of {N_LAYERS})",
            },
            {
                "from": NEGATIVE_BAND[0],
                "to": NEGATIVE_BAND[1],
                "band": f"paper: negative band (layers {NEGATIVE_LAYERS[0]}-{NEGATIVE_LAYERS[1]} of {N_LAYERS})",
            },
        ]
    )
    # legends below the plot, labels never shortened: the bands' labels are long, and the band and the
    # line of a domain share one legend (a layer without it would switch the legend off)
    band_legend = alt.Legend(orient="bottom", direction="vertical", labelLimit=0, symbolOpacity=0.5)
    domain_legend = alt.Legend(orient="bottom", labelLimit=0, symbolOpacity=1, symbolType="stroke", symbolStrokeWidth=3)
    shade = (
        alt.Chart(bands)
        .mark_rect(opacity=0.12)
        .encode(
            x=alt.X("from:Q"),
            x2="to:Q",
            color=alt.Color("band:N", scale=alt.Scale(range=["#2a9d8f", "#e63946"]), title=None, legend=band_legend),
        )
    )
    base = alt.Chart(depth).encode(
        x=alt.X("depth:Q", title="layer depth (layer / layers)", scale=alt.Scale(domain=[0, 1]))
    )
    interval = base.mark_area(opacity=0.15).encode(
        y="rho_lo:Q", y2="rho_hi:Q", fill=alt.Fill("domain:N", title="domain", legend=domain_legend)
    )
    lines = base.mark_line(point=True).encode(
        y=alt.Y("rho:Q", title="Spearman rho with occlusion importance"),
        stroke=alt.Stroke("domain:N", title="domain", legend=domain_legend),
        tooltip=[
            "domain",
            "task",
            "layer",
            alt.Tooltip("rho:Q", format="+.3f"),
            alt.Tooltip("rho_lo:Q", format="+.3f"),
            alt.Tooltip("rho_hi:Q", format="+.3f"),
            "n_samples",
        ],
    )
    ref = (
        alt.Chart(reference)
        .mark_line(strokeDash=[4, 3], color="gray", opacity=0.7)
        .encode(
            x="depth:Q",
            y="rho:Q",
            detail="dataset:N",
            tooltip=["dataset", "layer", alt.Tooltip("rho:Q", format="+.3f")],
        )
    )
    zero = alt.Chart(pd.DataFrame({"y": [0.0]})).mark_rule(color="black", opacity=0.4).encode(y="y:Q")
    return alt.layer(shade, ref, interval, lines, zero).resolve_scale(color="independent").properties(height=460)


def render(ctx) -> None:
    st.title("Signals")
    rows = _rows(ctx.url)
    if rows.empty:
        st.info("No signal studies stored yet. Run `kvleague signals --model M --task T --limit N --db URL`.")
        return
    labels = [label for label in ("occlusion_nll", "answer_flip") if (rows["label"] == label).any()]
    label = st.radio(
        "Importance label",
        labels,
        horizontal=True,
        key="sig_label",
        help="occlusion_nll: increase of the reference answer's NLL when a window is occluded (every sample); "
        "answer_flip: the authors' label, on samples the model answers correctly with the full context",
    )
    models = sorted(rows["model"].unique())
    model = st.selectbox("Model", models, key="sig_model") if len(models) > 1 else models[0]
    rows = rows[rows["model"] == model]
    settings = [x for x in sig.SETTINGS if (rows["occluded"] == x).any()]
    if len(settings) > 1:
        setting = st.radio(
            "Occlusion windows",
            settings,
            horizontal=True,
            key="sig_occluded",
            format_func=lambda x: sig.SETTING_TITLES[x],
            help="context: windows over the context before the answer, prompt included; trace: over the "
            "model's own trace only (the EpiKV authors' setting), each scored on the trace after it",
        )
        rows = rows[rows["occluded"] == setting]
        if not (rows["label"] == label).any():
            st.info(f"No {label} rows with {sig.SETTING_TITLES[setting]}.")
            return
    st.caption(
        "Per sample, windows of the context (32 tokens every 16 by default) are replaced by the pad token and the label "
        "of a token is the largest effect of a window covering it; each signal is correlated with the label by one "
        "Spearman rho over every context token of every sample (the EpiKV authors' pooling), with a 95% percentile "
        "bootstrap interval that resamples samples. The latest run of each task is shown (of each setting of the windows: "
        "over the context, or over the model's own trace as the EpiKV authors slide them)."
    )

    kind = st.radio(
        "Rho",
        [sig.RAW, sig.PARTIAL],
        horizontal=True,
        key="sig_kind",
        help="position held fixed: the rank partial correlation given the token's index in the context "
        "(labels and smoothed signals both drift with position)",
    )
    depth = (
        sig.depth_table(rows, label=label)
        if kind == sig.RAW
        else sig.depth_table(sig.position_held_fixed(rows), label=label).dropna(subset=["rho"])
    )
    st.subheader("Rho of the smoothed hidden-state change against layer depth")
    reference = sig.reference_series()
    shown = st.multiselect(
        "Authors' published series (DeepSeek-R1-Distill-Llama-8B, answer-flip labels)",
        sorted(reference["dataset"].unique()),
        default=["math500"],
        key="sig_reference",
    )
    if depth.empty:
        st.info(
            f"No per-layer rows for the label {label}"
            + ("." if kind == sig.RAW else " with position held fixed (runs before it have none).")
        )
    else:
        st.altair_chart(depth_chart(depth, reference[reference["dataset"].isin(shown)]), width="stretch")
        st.caption(
            f"Signal `{sig.DEPTH_FAMILY}_l{{layer}}`: the L2 change of layer l's hidden state from the previous "
            "token, averaged over the trailing 64 tokens. Dashed grey: the authors' figures, transcribed from "
            f"`results_recovered/*_signal_ablation.csv` of {SOURCE_REPOSITORY} at {SOURCE_COMMIT[:12]}."
        )
    verdicts = sig.verdict_table(rows, label)
    if not verdicts.empty:
        st.markdown(
            "**The paper's sign pattern per domain**, on the raw rho and with position held fixed "
            "(a layer counts only when its 95% interval excludes 0)"
        )
        st.dataframe(
            verdicts,
            hide_index=True,
            key="sig_bands",
            column_config={"mean rho early": RHO, "mean rho late": RHO, "samples": INT},
        )
    if not depth.empty:
        with st.expander(f"Every layer ({kind})"):
            st.dataframe(
                depth,
                hide_index=True,
                key="sig_depth",
                column_config={
                    "rho": RHO,
                    "rho_lo": RHO,
                    "rho_hi": RHO,
                    "depth": st.column_config.NumberColumn(format="%.2f"),
                },
            )

    st.subheader("Each method's own score per domain")
    methods = sig.method_table(rows, label)
    if methods.empty:
        st.info("No method scores stored for this label.")
    else:
        st.caption(
            "Every registered method's `score` through the method contract, read once on the full cache at the end "
            "of the trace (layers and heads averaged). An empty rho: the method scores every context token the same "
            "(methods that never evict prompt tokens score them all +inf)."
        )
        st.dataframe(
            methods,
            hide_index=True,
            key="sig_methods",
            placeholder="—",
            column_config={**RHOS, "n_samples": INT, "n_pairs": INT},
        )
    st.subheader("All-layer signals and the position control")
    st.dataframe(
        sig.signal_table(rows, label),
        hide_index=True,
        key="sig_all_layer",
        placeholder="—",
        column_config={**RHOS, "n_samples": INT, "n_pairs": INT},
    )
    st.caption(
        "partial_*: the rank partial rho with the token's position held fixed, with its interval on the same resamples."
    )
