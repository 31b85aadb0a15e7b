"""Tables of the signal studies (``kvleague signals``, table ``signal_correlations``) for the Signals page
and docs/signals.md: rho against layer depth per domain, rho per method per domain, and whether the
paper's sign pattern holds in its bands, judged by the per-layer intervals; each both raw and with the
token's position held fixed (the rank partial rho, ``partial_*`` columns; runs stored before it have none);
each per setting of the occlusion windows (``occluded``: over the context, or over the trace as the EpiKV
authors slide them; rows before migration 0009 are ``context``), and the two settings side by side
(:func:`setting_comparison`, :func:`setting_agreement`).

Run ``python -m analysis.signal_tables --db URL`` for the Markdown tables of a database.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, cast

import pandas as pd
from sqlalchemy import inspect, select

from kvleague.analysis.paper import N_LAYERS, NEGATIVE_BAND, POSITIVE_BAND, PUBLISHED_LAYER_RHO

#: the paper's per-layer signal
DEPTH_FAMILY = "hs_l2_diff_rolling64"
COLUMNS = [
    "run_id",
    "model",
    "task",
    "domain",
    "label",
    "signal",
    "family",
    "layer",
    "n_layers",
    "rho",
    "rho_lo",
    "rho_hi",
    "p_value",
    "n_samples",
    "n_pairs",
    "created_at",
    "control",
    "partial_rho",
    "partial_lo",
    "partial_hi",
    "occluded",
]
#: the two kinds of rho: as measured, and with the control (the token's position) held fixed
RAW, PARTIAL = "raw", "position held fixed"
#: where the occlusion windows slid (``signal_correlations.occluded``), in display order
SETTINGS = ("context", "trace")
SETTING_TITLES = {
    "context": "windows over the context before the answer (prompt included)",
    "trace": "windows over the model's own trace (the prompt never occluded; the EpiKV authors' setting)",
}


def read_correlations(engine) -> pd.DataFrame:
    """The latest run's rows of each (model, task, label, occluded); empty on a schema without the table."""
    from kvleague.db.models import SignalCorrelation

    if "signal_correlations" not in inspect(engine).get_table_names():
        return pd.DataFrame(columns=COLUMNS)
    t = SignalCorrelation.__table__
    present = {c["name"] for c in inspect(engine).get_columns("signal_correlations")}  # a database not yet at 0007/0009
    with engine.connect() as conn:
        rows = conn.execute(select(*[t.c[c] for c in COLUMNS if c in present]))
        df = pd.DataFrame([dict(r._mapping) for r in rows], columns=COLUMNS)
    if df.empty:
        return df
    df["occluded"] = df["occluded"].fillna("context")
    latest = df.sort_values("created_at").groupby(["model", "task", "label", "occluded"])["run_id"].last()
    return df[df["run_id"].isin(set(latest))].reset_index(drop=True)


def position_held_fixed(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with rho and its interval replaced by the partial rho given position (NaN where none), so
    every table below can show either."""
    out = df.copy()
    for raw, partial in (("rho", "partial_rho"), ("rho_lo", "partial_lo"), ("rho_hi", "partial_hi")):
        out[raw] = pd.to_numeric(out[partial], errors="coerce")
    return out


def depth_table(df: pd.DataFrame, family: str = DEPTH_FAMILY, label: str = "occlusion_nll") -> pd.DataFrame:
    """Per (model, domain, task) and layer: rho with its interval, at depth = layer / layers (the paper's
    layer 10 of 32 is depth 0.31)."""
    sel = df[(df["family"] == family) & (df["label"] == label)].copy()
    sel["layer"] = sel["layer"].astype(int)
    sel["depth"] = sel["layer"] / sel["n_layers"]
    sel["band"] = [band_of(d) for d in sel["depth"]]
    cols = ["model", "domain", "task", "layer", "depth", "band", "rho", "rho_lo", "rho_hi", "n_samples", "n_pairs"]
    return sel[cols].sort_values(["model", "domain", "task", "layer"]).reset_index(drop=True)


def band_of(depth: float) -> str:
    if POSITIVE_BAND[0] <= depth <= POSITIVE_BAND[1]:
        return "positive"
    if NEGATIVE_BAND[0] <= depth <= NEGATIVE_BAND[1]:
        return "negative"
    return ""


def band_verdicts(depth: pd.DataFrame) -> pd.DataFrame:
    """Per (model, domain, task): in each band, how many layers' 95% intervals lie above 0, below 0 or
    cover it, and a verdict on the paper's pattern (positive early band, negative late band) that claims
    only what the intervals show."""
    rows = []
    for (model, domain, task), g in depth.groupby(["model", "domain", "task"], sort=True):
        counts = {}
        for band in ("positive", "negative"):
            b = g[g["band"] == band]
            counts[band] = (int((b["rho_lo"] > 0).sum()), int((b["rho_hi"] < 0).sum()), len(b))
        (p_up, p_down, p_n), (n_up, n_down, n_n) = counts["positive"], counts["negative"]
        rows.append(
            {
                "model": model,
                "domain": domain,
                "task": task,
                "samples": int(g["n_samples"].max()),
                "early band: layers > 0": p_up,
                "early band: layers < 0": p_down,
                "early band: layers": p_n,
                "late band: layers > 0": n_up,
                "late band: layers < 0": n_down,
                "late band: layers": n_n,
                "mean rho early": float(g[g["band"] == "positive"]["rho"].mean()),
                "mean rho late": float(g[g["band"] == "negative"]["rho"].mean()),
                "verdict": _verdict(p_up, p_down, p_n, n_up, n_down, n_n),
            }
        )
    return pd.DataFrame(rows)


def verdict_table(df: pd.DataFrame, label: str = "occlusion_nll") -> pd.DataFrame:
    """The band verdicts on the raw rho and on the rho with position held fixed, one row each per
    (model, domain, task); a run without partial rho gets only its raw rows."""
    parts = []
    for kind, rows in ((RAW, df), (PARTIAL, position_held_fixed(df))):
        depth = depth_table(rows, label=label).dropna(subset=["rho"])
        if not depth.empty:
            parts.append(band_verdicts(depth).assign(rho=kind))
    if not parts:
        return pd.DataFrame()
    out = pd.concat(parts, ignore_index=True)
    return out[["rho", *[c for c in out.columns if c != "rho"]]]


def _verdict(p_up: int, p_down: int, p_n: int, n_up: int, n_down: int, n_n: int) -> str:
    early = "positive" if p_up > p_n / 2 and not p_down else "negative" if p_down > p_n / 2 and not p_up else "unclear"
    late = "negative" if n_down > n_n / 2 and not n_up else "positive" if n_up > n_n / 2 and not n_down else "unclear"
    if early == "positive" and late == "negative":
        return "holds: most early-band layers above 0, most late-band layers below 0"
    if early == "unclear" and late == "unclear":
        return "not resolved: most band layers' intervals cover 0 or disagree"
    return f"does not hold as stated: early band {early}, late band {late}"


def method_table(df: pd.DataFrame, label: str = "occlusion_nll") -> pd.DataFrame:
    """Per method and (model, domain, task): rho of the method's own score with its interval."""
    sel = df[(df["family"] == "method") & (df["label"] == label)].copy()
    sel["method"] = sel["signal"].str.removeprefix("method:")
    cols = [
        "method",
        "model",
        "domain",
        "task",
        "rho",
        "rho_lo",
        "rho_hi",
        "partial_rho",
        "partial_lo",
        "partial_hi",
        "n_samples",
        "n_pairs",
    ]
    return sel[cols].sort_values(["domain", "rho"], ascending=[True, False], na_position="last").reset_index(drop=True)


def signal_table(df: pd.DataFrame, label: str = "occlusion_nll") -> pd.DataFrame:
    """The all-layer signals (the authors' kv and attention signals) and the position control per
    (model, domain, task)."""
    sel = df[(df["label"] == label) & (df["signal"].str.endswith("_mean") | (df["signal"] == "position"))]
    cols = [
        "signal",
        "model",
        "domain",
        "task",
        "rho",
        "rho_lo",
        "rho_hi",
        "partial_rho",
        "partial_lo",
        "partial_hi",
        "n_samples",
        "n_pairs",
    ]
    return sel[cols].sort_values(["domain", "signal"]).reset_index(drop=True)


def headline(signal: str) -> bool:
    """The signals with intervals by default (``kvleague signals`` without ``--all-intervals``): the paper's
    per-layer signal, the all-layer signals, the position control and the methods."""
    return signal.startswith((f"{DEPTH_FAMILY}_l", "method:")) or signal.endswith("_mean") or signal == "position"


def _group(signal: str) -> str:
    if signal.startswith("method:"):
        return "methods"
    if signal.startswith(f"{DEPTH_FAMILY}_l"):
        return f"{DEPTH_FAMILY} per layer"
    return "all-layer signals and position"


def _sign(lo: float, hi: float) -> int:
    """+1 / -1 when the interval lies above / below 0, 0 when it covers 0 (or there is none)."""
    return 1 if lo > 0 else -1 if hi < 0 else 0


def setting_comparison(df: pd.DataFrame, label: str = "occlusion_nll", kind: str = RAW) -> pd.DataFrame:
    """Per (model, domain, task) and headline signal, the rho of each setting of the windows side by side
    (``kind``: raw, or with position held fixed), and how they compare: ``sign`` (both intervals on the
    same side of 0: "same"; on opposite sides: "opposite"; else "one covers 0" / "both cover 0") and
    ``overlap`` (whether the two intervals overlap). Only signals with an interval in both settings."""
    rows = df if kind == RAW else position_held_fixed(df)
    sel = rows[(rows["label"] == label) & rows["signal"].map(headline)].dropna(subset=["rho", "rho_lo", "rho_hi"])
    if kind == PARTIAL:
        sel = sel[sel["signal"] != "position"]
    keys = ["model", "domain", "task", "signal"]
    cols = ["rho", "rho_lo", "rho_hi", "n_samples"]
    context = sel[sel["occluded"] == "context"][keys + cols]
    trace = sel[sel["occluded"] == "trace"][keys + cols]
    both = context.merge(trace, on=keys, suffixes=("_context", "_trace"))
    if both.empty:
        return pd.DataFrame(columns=[*keys, "group", "sign", "overlap"])
    signs = [
        (_sign(r.rho_lo_context, r.rho_hi_context), _sign(r.rho_lo_trace, r.rho_hi_trace))
        for r in cast("list[Any]", list(both.itertuples()))
    ]
    both["sign"] = [
        "same" if a and a == b else "opposite" if a and b else "both cover 0" if not a and not b else "one covers 0"
        for a, b in signs
    ]
    both["overlap"] = (both["rho_lo_context"] <= both["rho_hi_trace"]) & (
        both["rho_lo_trace"] <= both["rho_hi_context"]
    )
    both["group"] = both["signal"].map(_group)
    return both.sort_values(
        ["domain", "task", "group", "signal"], key=lambda c: _domain_order(c) if c.name == "domain" else c
    ).reset_index(drop=True)


def setting_agreement(df: pd.DataFrame, label: str = "occlusion_nll", kind: str = RAW) -> pd.DataFrame:
    """Per (model, domain, task) and signal group (the per-layer signal, the all-layer signals, the
    methods), how far the two settings agree: signals compared, how many have intervals on the same side
    of 0 in both, on opposite sides, covering 0 in one or both, how many intervals overlap, and Spearman's
    rho between the two settings' rhos over the group's signals (do they rank the signals alike)."""
    from scipy.stats import spearmanr

    comp = setting_comparison(df, label, kind)
    rows = []
    for (model, domain, task, group), g in comp.groupby(["model", "domain", "task", "group"], sort=False):
        test: Any = (
            spearmanr(g["rho_context"], g["rho_trace"]) if len(g) > 2 else None
        )  # scipy's result types are not declared
        rank = float(test.statistic) if test is not None else float("nan")
        rows.append(
            {
                "model": model,
                "domain": domain,
                "task": task,
                "signals": group,
                "n context": int(g["n_samples_context"].max()),
                "n trace": int(g["n_samples_trace"].max()),
                "compared": len(g),
                "same sign": int((g["sign"] == "same").sum()),
                "opposite sign": int((g["sign"] == "opposite").sum()),
                "one covers 0": int((g["sign"] == "one covers 0").sum()),
                "both cover 0": int((g["sign"] == "both cover 0").sum()),
                "intervals overlap": int(g["overlap"].sum()),
                "rank rho of the rhos": rank,
            }
        )
    return pd.DataFrame(rows)


def _side_by_side(comp: pd.DataFrame, group: str) -> pd.DataFrame:
    """Signal by task, each task a (context, trace) pair of rho [lo, hi] cells."""
    g = comp[comp["group"] == group]
    tasks = list(dict.fromkeys(g.sort_values("domain", key=_domain_order, kind="stable")["task"]))
    out = {}
    for task in tasks:
        t = g[g["task"] == task].set_index("signal")
        for setting in SETTINGS:
            cells = t[[f"rho_{setting}", f"rho_lo_{setting}", f"rho_hi_{setting}"]].set_axis(
                ["rho", "rho_lo", "rho_hi"], axis=1
            )
            n = int(t[f"n_samples_{setting}"].max())
            out[f"{task} {setting} (n={n})"] = cells.apply(_interval, axis=1)
        out[f"{task}: sign, overlap"] = t["sign"] + ", " + t["overlap"].map({True: "overlap", False: "apart"})
    wide = pd.DataFrame(out).fillna("—")  # a signal compared in some tasks only
    if group == f"{DEPTH_FAMILY} per layer":
        wide = wide.loc[sorted(wide.index, key=lambda name: int(name.rsplit("_l", 1)[1]))]
    return wide


def comparison_markdown(df: pd.DataFrame, label: str = "occlusion_nll") -> str:
    """The two settings of the windows side by side for ``label``: the agreement per task and signal group,
    then the all-layer signals and the methods (raw, then with position held fixed); empty unless a task
    has both settings."""
    out = []
    for kind in (RAW, PARTIAL):
        comp = setting_comparison(df, label, kind)
        if comp.empty:
            continue
        what = "rho" if kind == RAW else "partial rho, position held fixed"
        agree = setting_agreement(df, label, kind)
        agree["signals"] = agree["signals"].astype(str)
        out += [
            f"### Windows over the context vs over the trace: agreement ({label}, {what})",
            "",
            agree.drop(columns=["model"]).to_markdown(index=False, floatfmt="+.3f"),
            "",
        ]
        for group in ("all-layer signals and position", "methods", f"{DEPTH_FAMILY} per layer"):
            if (comp["group"] == group).any():
                out += [
                    f"#### {group}: context vs trace ({label}, {what}, 95% interval)",
                    "",
                    _side_by_side(comp, group).to_markdown(),
                    "",
                ]
    return "\n".join(out)


def reference_series() -> pd.DataFrame:
    """The authors' published per-layer rho (analysis/paper.yaml) at depth = layer / 32."""
    rows = [
        {"dataset": name, "layer": i, "depth": i / N_LAYERS, "rho": rho, "source": source}
        for name, (source, _, values) in PUBLISHED_LAYER_RHO.items()
        for i, rho in enumerate(values)
    ]
    return pd.DataFrame(rows)


def _domain_order(domains: pd.Series) -> pd.Series:
    """The project's domain order (math, code, agentic, longqa), for sorting."""
    from kvleague.tasks.base import DOMAINS

    return domains.map({d: i for i, d in enumerate(DOMAINS)})


def _interval(row) -> str:
    if pd.isna(row["rho"]):
        return "—"
    if pd.isna(row["rho_lo"]):  # not computed, or some resample's signal or label is constant
        return f"{row['rho']:+.3f} (no interval)"
    return f"{row['rho']:+.3f} [{row['rho_lo']:+.3f}, {row['rho_hi']:+.3f}]"


def _wide(table: pd.DataFrame, index: str) -> pd.DataFrame:
    """``index`` by task (domain order), each cell rho [lo, hi]."""
    table = table.assign(rho_interval=table.apply(_interval, axis=1))
    wide = table.pivot_table(index=index, columns="task", values="rho_interval", aggfunc="first")
    return wide[list(dict.fromkeys(table.sort_values("domain", key=_domain_order)["task"]))]


def _depth_markdown(depth: pd.DataFrame, model: str, label: str, kind: str) -> list[str]:
    tasks = list(dict.fromkeys(depth.sort_values("domain", key=_domain_order)["task"]))
    n = {t: int(depth[depth["task"] == t]["n_samples"].max()) for t in tasks}
    header = (
        "| layer | depth | band | "
        + " | ".join(f"{t} ({depth[depth['task'] == t]['domain'].iloc[0]}, n={n[t]})" for t in tasks)
        + " |"
    )
    what = "rho" if kind == RAW else "partial rho with the token's position held fixed"
    out = [
        f"### {model}: {what} of {DEPTH_FAMILY} against {label}, 95% interval",
        "",
        header,
        "|" + "---|" * (3 + len(tasks)),
    ]
    for layer, lg in depth.groupby("layer"):
        cells = [_interval(lg[lg["task"] == t].iloc[0]) if (lg["task"] == t).any() else "—" for t in tasks]
        out.append(f"| {layer} | {lg['depth'].iloc[0]:.2f} | {lg['band'].iloc[0]} | " + " | ".join(cells) + " |")
    return out + [""]


def markdown(df: pd.DataFrame, label: str = "occlusion_nll") -> str:
    """For ``label``: the depth tables (one column per task; raw, then with position held fixed), the band
    verdicts on both, the method table and the all-layer signals (raw and with position held fixed)."""
    out = []
    for kind, rows in ((RAW, df), (PARTIAL, position_held_fixed(df))):
        depth = (
            depth_table(rows, label=label).dropna(subset=["rho"]) if kind == PARTIAL else depth_table(rows, label=label)
        )
        for model, g in depth.groupby("model"):
            out += _depth_markdown(g, str(model), label, kind)
    verdicts = verdict_table(df, label)
    if not verdicts.empty:
        verdicts = verdicts.sort_values("domain", key=_domain_order, kind="stable")
        out += [
            f"### The paper's sign pattern per domain ({label}; raw rho and with position held fixed)",
            "",
            verdicts.to_markdown(index=False, floatfmt="+.3f"),
            "",
        ]
    for kind, rows in ((RAW, df), (PARTIAL, position_held_fixed(df))):
        methods = method_table(rows, label)
        if not methods.empty and (kind == RAW or methods["rho"].notna().any()):
            what = "rho" if kind == RAW else "partial rho, position held fixed"
            out += [
                f"### Each method's own score against {label} ({what}, 95% interval; — : constant on the context)",
                "",
                _wide(methods, "method").to_markdown(),
                "",
            ]
        signals = signal_table(rows, label)
        if kind == PARTIAL:
            signals = signals[signals["signal"] != "position"]
        if not signals.empty and (kind == RAW or signals["rho"].notna().any()):
            what = "and the position control" if kind == RAW else "with position held fixed"
            out += [f"### All-layer signals {what} against {label}", "", _wide(signals, "signal").to_markdown(), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from kvleague.db.session import get_engine

    p = argparse.ArgumentParser(prog="python -m analysis.signal_tables", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--db", required=True, metavar="URL")
    p.add_argument("--label", action="append", default=None, help="importance label(s) (default: every label stored)")
    args = p.parse_args(argv)
    df = read_correlations(get_engine(args.db))
    for label in args.label or [x for x in ("occlusion_nll", "answer_flip") if (df["label"] == x).any()]:
        settings = [x for x in SETTINGS if ((df["occluded"] == x) & (df["label"] == label)).any()]
        if len(settings) <= 1:  # one setting: its tables, as before the trace setting existed
            print(markdown(df, label))
            continue
        for setting in settings:
            print(f"## {label}: {SETTING_TITLES[setting]}\n")
            print(markdown(df[df["occluded"] == setting], label))
        comparison = comparison_markdown(df, label)
        if comparison:
            print(f"## {label}: the two settings side by side\n")
            print(comparison)
    return 0


if __name__ == "__main__":
    sys.exit(main())
