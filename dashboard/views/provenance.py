"""Provenance: the sweeps, code, libraries, hardware, seeds and protocol behind the numbers shown."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import streamlit as st

from kvleague.analysis import queries as q
from kvleague.dashboard.views.common import empty, plain

SWEEP_COLUMNS = [
    "id",
    "name",
    "status",
    "rows",
    "ok_rows",
    "git_commit",
    "git_dirty",
    "started_at",
    "finished_at",
    "config_path",
    "config_hash",
    "ray_job_id",
    "hostname",
    "gpu_name",
    "gpu_count",
    "torch_version",
    "transformers_version",
    "cuda_version",
    "python_version",
    "kvleague_version",
    "ray_version",
    "platform",
]
ENV_COLUMNS = [
    "id",
    "rows",
    "hostname",
    "gpu_name",
    "gpu_count",
    "cuda_version",
    "torch_version",
    "transformers_version",
    "python_version",
    "kvleague_version",
    "ray_version",
    "platform",
    "git_commit",
    "git_dirty",
]


def render(ctx) -> None:
    st.title("Provenance")
    methods = ctx.opts.methods
    chosen = st.multiselect(
        "Method (empty: all)", list(methods), format_func=lambda i: methods[i]["label"], key="pv_method"
    )
    st.caption(
        "Everything behind the rows that match the filters (and the methods chosen here): generations and "
        "fidelity measurements alike."
    )
    data = ctx.data(q.provenance, replace(ctx.filters, measure=None), tuple(chosen) if chosen else None)
    if not data["sweeps"]:
        empty()
        return
    st.subheader("Sweeps")
    sweeps = pd.DataFrame(data["sweeps"])
    st.dataframe(
        sweeps[[c for c in SWEEP_COLUMNS if c in sweeps.columns]], hide_index=True, placeholder="—", key="pv_sweeps"
    )
    st.subheader("Where the results were produced")
    envs = pd.DataFrame(data["environments"])
    if not envs.empty:
        st.dataframe(
            envs[[c for c in ENV_COLUMNS if c in envs.columns]], hide_index=True, placeholder="—", key="pv_envs"
        )
    c1, c2 = st.columns(2)
    with c1:
        st.subheader("Seeds")
        st.dataframe(pd.DataFrame(data["seeds"]), hide_index=True, placeholder="—", key="pv_seeds")
        st.subheader("Models")
        st.dataframe(pd.DataFrame(data["models"]), hide_index=True, placeholder="—", key="pv_models")
    with c2:
        st.subheader("Protocols")
        st.dataframe(pd.DataFrame(data["protocols"]), hide_index=True, placeholder="—", key="pv_protocols")
        st.subheader("Generation settings")
        st.dataframe(pd.DataFrame(data["generations"]), hide_index=True, placeholder="—", key="pv_generations")
    st.subheader("Tasks")
    st.dataframe(pd.DataFrame(data["tasks"]), hide_index=True, placeholder="—", key="pv_tasks")
    for s in data["sweeps"]:
        with st.expander(f"Sweep #{s['id']} {plain(s['name'])}: configuration"):
            st.json(s.get("config") or {})
