"""Replication scorecard: the EpiKV family against the best attention-based baseline and full cache, and
the paper's published claims beside kvleague's measurements."""

from __future__ import annotations

import streamlit as st

from dashboard import queries as q
from dashboard.views.common import empty, styled


def render(ctx) -> None:
    st.title("Replication scorecard")
    st.caption(
        f"Reference family: {', '.join(q.REFERENCE_FAMILY)}. Attention-based baselines: {', '.join(q.ATTENTION_BASELINES)} "
        "(the best one per domain and budget, by accuracy). Against the baseline the claim is *better*: replicates when the "
        "paired test finds the EpiKV method significantly better (p < 0.05), does not replicate when significantly worse. "
        "Against full cache the claim is *close*: replicates when the whole 95% interval of the difference lies above "
        "minus the margin, does not replicate when it lies entirely below."
    )
    margin = st.number_input("Margin for 'close to full cache' (points)", min_value=0.0, max_value=50.0, value=5.0, step=0.5,
                             key="sc_margin")
    st.subheader("The paper's claims and kvleague's measurements")
    claims = ctx.data("paper_claims", ctx.filters)
    st.dataframe(claims, hide_index=True, placeholder="—", key="sc_claims")
    st.caption("Measured on the same task and budget, under the model, protocol and decoding filters; "
               "a claim with no matching results reads 'not measured yet'.")
    st.subheader("Per domain and budget")
    card = ctx.data("scorecard", ctx.filters, float(margin))
    if card.empty:
        empty("No EpiKV-family results match the filters.")
        return
    st.dataframe(styled(card, pct=("accuracy", "baseline %", "full %"), pp=("Δ baseline", "Δ full"), p=("p baseline", "p full")),
                 hide_index=True, placeholder="—", key="sc_card")
    st.download_button("Download CSV", card.to_csv(index=False).encode(), file_name="kvleague-scorecard.csv",
                       mime="text/csv", key="sc_csv")
