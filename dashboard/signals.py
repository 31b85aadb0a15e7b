"""Tables of the signal studies (``kvleague signals``, table ``signal_correlations``) for the Signals page
and docs/signals.md: rho against layer depth per domain, rho per method per domain, and whether the
paper's sign pattern holds in its bands, judged by the per-layer intervals.

Run ``python -m dashboard.signals --db URL`` for the Markdown tables of a database.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
from sqlalchemy import inspect, select

from dashboard.paper import N_LAYERS, NEGATIVE_BAND, POSITIVE_BAND, PUBLISHED_LAYER_RHO

#: the paper's per-layer signal
DEPTH_FAMILY = "hs_l2_diff_rolling64"
COLUMNS = ["run_id", "model", "task", "domain", "label", "signal", "family", "layer", "n_layers", "rho", "rho_lo",
           "rho_hi", "p_value", "n_samples", "n_pairs", "created_at"]


def read_correlations(engine) -> pd.DataFrame:
    """The latest run's rows of each (model, task, label); empty on a schema without the table."""
    from db.models import SignalCorrelation

    if "signal_correlations" not in inspect(engine).get_table_names():
        return pd.DataFrame(columns=COLUMNS)
    t = SignalCorrelation.__table__
    with engine.connect() as conn:
        df = pd.DataFrame([dict(r._mapping) for r in conn.execute(select(*[t.c[c] for c in COLUMNS]))], columns=COLUMNS)
    if df.empty:
        return df
    latest = df.sort_values("created_at").groupby(["model", "task", "label"])["run_id"].last()
    return df[df["run_id"].isin(set(latest))].reset_index(drop=True)


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
        rows.append({
            "model": model, "domain": domain, "task": task, "samples": int(g["n_samples"].max()),
            "early band: layers > 0": p_up, "early band: layers < 0": p_down, "early band: layers": p_n,
            "late band: layers > 0": n_up, "late band: layers < 0": n_down, "late band: layers": n_n,
            "mean rho early": float(g[g["band"] == "positive"]["rho"].mean()),
            "mean rho late": float(g[g["band"] == "negative"]["rho"].mean()),
            "verdict": _verdict(p_up, p_down, p_n, n_up, n_down, n_n),
        })
    return pd.DataFrame(rows)


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
    cols = ["method", "model", "domain", "task", "rho", "rho_lo", "rho_hi", "n_samples", "n_pairs"]
    return sel[cols].sort_values(["domain", "rho"], ascending=[True, False], na_position="last").reset_index(drop=True)


def signal_table(df: pd.DataFrame, label: str = "occlusion_nll") -> pd.DataFrame:
    """The all-layer signals (the authors' kv and attention signals) and the position control per
    (model, domain, task)."""
    sel = df[(df["label"] == label) & (df["signal"].str.endswith("_mean") | (df["signal"] == "position"))]
    cols = ["signal", "model", "domain", "task", "rho", "rho_lo", "rho_hi", "n_samples", "n_pairs"]
    return sel[cols].sort_values(["domain", "signal"]).reset_index(drop=True)


def reference_series() -> pd.DataFrame:
    """The authors' published per-layer rho (dashboard/paper.yaml) at depth = layer / 32."""
    rows = [{"dataset": name, "layer": i, "depth": i / N_LAYERS, "rho": rho, "source": source}
            for name, (source, _, values) in PUBLISHED_LAYER_RHO.items() for i, rho in enumerate(values)]
    return pd.DataFrame(rows)


def _domain_order(domains: pd.Series) -> pd.Series:
    """The project's domain order (math, code, agentic, longqa), for sorting."""
    from tasks.base import DOMAINS

    return domains.map({d: i for i, d in enumerate(DOMAINS)})


def _interval(row) -> str:
    if pd.isna(row["rho"]):
        return "—"
    if pd.isna(row["rho_lo"]):  # not computed, or some resample's signal or label is constant
        return f"{row['rho']:+.3f} (no interval)"
    return f"{row['rho']:+.3f} [{row['rho_lo']:+.3f}, {row['rho_hi']:+.3f}]"


def markdown(df: pd.DataFrame) -> str:
    """The depth table (one column per task), the band verdicts and the method table, in Markdown."""
    depth = depth_table(df)
    out = []
    for model, g in depth.groupby("model"):
        tasks = list(dict.fromkeys(g.sort_values("domain", key=_domain_order)["task"]))
        n = {t: int(g[g["task"] == t]["n_samples"].max()) for t in tasks}
        header = "| layer | depth | band | " + " | ".join(f"{t} ({g[g['task'] == t]['domain'].iloc[0]}, n={n[t]})" for t in tasks) + " |"
        out += [f"### {model}: rho of {DEPTH_FAMILY} against occlusion_nll, 95% interval", "", header,
                "|" + "---|" * (3 + len(tasks))]
        for layer, lg in g.groupby("layer"):
            cells = [_interval(lg[lg["task"] == t].iloc[0]) if (lg["task"] == t).any() else "—" for t in tasks]
            out.append(f"| {layer} | {lg['depth'].iloc[0]:.2f} | {lg['band'].iloc[0]} | " + " | ".join(cells) + " |")
        out.append("")
    verdicts = band_verdicts(depth)
    if not verdicts.empty:
        verdicts = verdicts.sort_values("domain", key=_domain_order)
        out += ["### The paper's sign pattern per domain", "", verdicts.to_markdown(index=False, floatfmt="+.3f"), ""]
    methods = method_table(df)
    if not methods.empty:
        methods = methods.assign(rho_interval=methods.apply(_interval, axis=1))
        wide = methods.pivot_table(index="method", columns="task", values="rho_interval", aggfunc="first")
        wide = wide[list(dict.fromkeys(methods.sort_values("domain", key=_domain_order)["task"]))]
        out += ["### Each method's own score against occlusion_nll (rho, 95% interval; — : constant on the context)", "",
                wide.to_markdown(), ""]
    signals = signal_table(df)
    if not signals.empty:
        signals = signals.assign(rho_interval=signals.apply(_interval, axis=1))
        wide = signals.pivot_table(index="signal", columns="task", values="rho_interval", aggfunc="first")
        wide = wide[list(dict.fromkeys(signals.sort_values("domain", key=_domain_order)["task"]))]
        out += ["### All-layer signals and the position control against occlusion_nll", "", wide.to_markdown(), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from db.session import get_engine

    p = argparse.ArgumentParser(prog="python -m dashboard.signals", description=__doc__.splitlines()[0])
    p.add_argument("--db", required=True, metavar="URL")
    args = p.parse_args(argv)
    print(markdown(read_correlations(get_engine(args.db))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
