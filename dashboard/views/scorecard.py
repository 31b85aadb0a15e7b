"""Replication scorecard: the EpiKV family against the paper's baselines (H2O, ThinKV) and full cache,
and the paper's published claims beside kvleague's measurements."""

from __future__ import annotations

import streamlit as st

from kvleague.analysis import fidelity_tables, paper, stats, tables, verdicts
from kvleague.dashboard.views.common import empty, pick_weighting, styled


def render(ctx) -> None:
    st.title("Replication scorecard")
    st.caption(
        f"Reference family: {', '.join(paper.REFERENCE_FAMILY)}. Baselines: {', '.join(paper.PAPER_BASELINES)}, the ones the "
        "paper compares with, fixed in advance (never the best one on the same data). One row per claim: *better than* a "
        "baseline (score test of Δ = 0) and *within the margin of full cache* (score test of Δ = -margin). Each claim "
        "uses the problem cells the method and its reference have in the (domain, budget), failed samples counted as "
        "wrong, questions as the unit. Δ: method minus reference in points with the interval of its test; p: the raw p "
        f"of the claim's test; p (adj.): {verdicts.FAMILY_TEXT}, the same for this pair on every page. Verdict: replicates "
        "when p (adj.) < 0.05 with the estimate on the claimed side, does not replicate when p (adj.) < 0.05 on the other "
        "side, else inconclusive; "
        f"fewer than {stats.MIN_PROBLEMS} questions: too few problems, no verdict."
    )
    c1, c2 = st.columns(2)
    with c1:
        margin = st.number_input(
            "Margin for 'close to full cache' (points)",
            min_value=0.0,
            max_value=50.0,
            value=5.0,
            step=0.5,
            key="sc_margin",
        )
    with c2:
        weighting = pick_weighting("sc_weighting")
    st.subheader("The paper's claims and kvleague's measurements")
    claims = ctx.data(tables.paper_claims, ctx.filters)
    # the measured value names its method, task and budget: wide enough to read whole
    st.dataframe(
        styled(claims, p=("p vs paper", "p vs paper (Holm)")),
        hide_index=True,
        placeholder="—",
        key="sc_claims",
        column_config={"kvleague": st.column_config.TextColumn(width="large")},
    )
    st.caption(
        "Measured on the same task and budget, under the model, protocol and decoding filters, for the method "
        "named (the spec with the most samples), failed samples counted as wrong. p vs paper: two-sided score "
        "test of kvleague's accuracy = the paper's value (the test dual to the Wilson interval shown, design effect "
        "for several samples per question), Holm-adjusted over the accuracy claims. 'consistent with the paper' "
        "means the data do not reject the paper's value, not that they confirm it."
    )
    st.subheader("Per domain and budget")
    card = ctx.data(tables.scorecard, ctx.filters, float(margin), None, weighting)
    if card.empty:
        empty("No EpiKV-family accuracy results match the filters.")
    else:
        st.dataframe(
            styled(card, pct=("accuracy", "reference %"), pp=("Δ",), p=("p", "p (adj.)")),
            hide_index=True,
            placeholder="—",
            key="sc_card",
        )
        st.download_button(
            "Download CSV",
            card.to_csv(index=False).encode(),
            file_name="kvleague-scorecard.csv",
            mime="text/csv",
            key="sc_csv",
        )
    fidelity_claims(ctx)
    protocol_ablations(ctx)


def protocol_ablations(ctx) -> None:
    chosen = [p for p in ctx.opts.protocols if ctx.filters.protocols is None or p["id"] in ctx.filters.protocols]
    table = ctx.data(fidelity_tables.protocol_ablations, ctx.filters, chosen)
    if table.empty:
        return
    st.subheader("Protocol ablations")
    st.caption(
        "Two protocols that differ in exactly one setting (field: which one), the same method at the same budget on the "
        "samples every method there has under both: mean KL(full || method) under A and under B, the paired mean "
        "difference B − A, the two-sided Wilcoxon signed-rank p of the differences (float32-rounding ties left out: "
        f"**tied**) with its Hodges–Lehmann shift and interval; {verdicts.FAMILY_TEXT}. It shows what "
        "the protocol, not the method, decides."
    )
    st.dataframe(
        styled(
            table.drop(columns=["Δ KL lo", "Δ KL hi", "sign"]),
            p=("p (Wilcoxon)", "p (adj.)"),
            formats={"KL A": "{:.4f}", "KL B": "{:.4f}", "Δ KL (B−A)": "{:+.4f}"},
        ),
        hide_index=True,
        placeholder="—",
        key="sc_ablations",
    )


def fidelity_claims(ctx) -> None:
    card = ctx.data(fidelity_tables.fidelity_scorecard, ctx.filters)
    if card.empty:
        return
    st.subheader("By fidelity, where accuracy cannot separate the methods")
    st.caption(
        f"The rule: in a (domain, budget) where full cache is right on fewer than {fidelity_tables.ACCURACY_FLOOR:g}% of the "
        "questions (a small model on math, code or agentic tasks), or where there are no accuracy results, every method "
        "sits near the floor and accuracy cannot tell them apart; there the claim *better than* a paper baseline is "
        "judged by fidelity to the full cache instead: *closer to full cache* = lower mean KL(full || method) on the "
        "samples both have. Δ KL: mean difference, descriptive; HL shift: the Hodges–Lehmann estimate with the interval "
        "inverting the test; p: two-sided Wilcoxon signed-rank test of the paired KL differences; p (adj.): "
        f"{verdicts.FAMILY_TEXT}, the same as in the fidelity pairs table. Verdict: replicates when p (adj.) < 0.05 with "
        "lower KL, does not replicate when p (adj.) < 0.05 with higher KL, equivalent within the declared margin when "
        "that is tested, else inconclusive; "
        f"fewer than {stats.MIN_PROBLEMS} samples: no verdict."
    )
    st.dataframe(
        styled(card, p=("p", "p (adj.)"), formats={"KL": "{:.4f}", "reference KL": "{:.4f}", "Δ KL": "{:+.4f}"}),
        hide_index=True,
        placeholder="—",
        key="sc_fidelity",
    )
