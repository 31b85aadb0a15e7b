"""Fidelity to the full cache (issue 16; rows of ``measure: fidelity`` sweeps, ``runner/fidelity.py``):
the tables behind the leaderboard's fidelity section, the fidelity budget curves and the scorecard's
fidelity claims.

* Per method, budget and domain (or task): the mean over samples of each sample's mean KL(full ||
  method) (nats per token) and top-1 agreement, with 95% percentile bootstrap intervals over samples
  (:func:`bootstrap_mean_interval`: ``scipy.stats.bootstrap``, 2,000 resamples, seed 0).
* Paired differences between methods on the samples both have: the mean difference with its bootstrap
  interval (resampling samples, so the pairing is kept) and Wilcoxon's signed-rank p of the KL
  differences (``scipy.stats.wilcoxon``), Holm-adjusted over every pair shown.

The unit is the sample (one ``sample_id`` of one task); a sample with several cells (models, protocols,
seeds) counts once, with the mean over its cells. Each table compares its methods on the samples all of
them have. Full cache does not depend on the budget: its rows at the budget where it has the most samples
stand in at every budget.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Iterable

import numpy as np
import pandas as pd
from scipy.stats import bootstrap, wilcoxon

from dashboard import common_set as cs
from dashboard import multiplicity, stats
from dashboard import queries as q
from dashboard.paper import PAPER_BASELINES, REFERENCE_FAMILY
from dashboard.tables import full_cache_ids, full_reference_budget, method_label

LEVEL = stats.LEVEL
N_RESAMPLES = 2000
#: the scorecard's rule: below this full-cache accuracy (%) in a domain at a budget, accuracy cannot
#: separate methods (every method sits near the floor), so the scorecard judges them by fidelity
ACCURACY_FLOOR = 20.0

Question = tuple[int, str]  # (task id, sample id)


@dataclass(frozen=True)
class SampleFidelity:
    """One sample's figures: means over its cells of the per-cell means, and the tokens scored in all."""

    kl: float
    top1: float
    delta_nll: float
    tokens: int


#: method spec id -> budget -> question -> figures
Fidelity = dict[int, dict[int, dict[Question, SampleFidelity]]]


def bootstrap_mean_interval(values: Iterable[float], level: float = LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over ``values`` (the samples are the unit). A single
    value or constant values: the value itself (no spread to resample); none: NaN."""
    v = np.asarray(list(values), dtype=float)
    if len(v) == 0:
        return math.nan, math.nan
    if len(v) < 2 or np.all(v == v[0]):
        return float(v[0]), float(v[0])
    res = bootstrap((v,), np.mean, n_resamples=N_RESAMPLES, confidence_level=level, method="percentile",
                    random_state=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def wilcoxon_p(differences: Iterable[float]) -> float:
    """Two-sided Wilcoxon signed-rank p of paired differences; 1 when all are zero (identical methods),
    NaN when there are none."""
    d = np.asarray(list(differences), dtype=float)
    if len(d) == 0:
        return math.nan
    if np.all(d == 0):
        return 1.0
    return float(wilcoxon(d).pvalue)


def load(engine, filters: q.Filters, budgets: Iterable[int] | None = None) -> Fidelity:
    """The fidelity rows under the filters, one entry per sample (its cells averaged)."""
    cells: dict[tuple[int, int, Question], list[tuple]] = defaultdict(list)
    for m, b, t, s, _model, _proto, _seed, kl, top1, dnll, tokens in q.fidelity_rows(engine, filters, budgets):
        cells[(int(m), int(b), (int(t), str(s)))].append((float(kl), float(top1), float(dnll or 0.0), int(tokens or 0)))
    out: Fidelity = defaultdict(lambda: defaultdict(dict))
    for (m, b, question), vals in cells.items():
        arr = np.array([v[:3] for v in vals])
        kl, top1, dnll = arr.mean(axis=0)
        out[m][b][question] = SampleFidelity(float(kl), float(top1), float(dnll), sum(v[3] for v in vals))
    return out


def at_budget(data: Fidelity, budget: int, full_ids: list[int]) -> tuple[dict[int, dict[Question, SampleFidelity]], int | None]:
    """Every method's samples at ``budget``; full cache from the budget where it has the most samples
    (this one on a tie): it is the same at every budget, and a sweep measures it at its first budget
    only. Returns ``(method -> samples, full cache's budget)``."""
    out = {m: by_budget[budget] for m, by_budget in data.items() if m not in full_ids and by_budget.get(budget)}
    full_budget = None
    for f in sorted(full_ids):
        by_budget = data.get(f, {})
        if not by_budget:
            continue
        b = max(by_budget, key=lambda x: (len(by_budget[x]), x == budget, -x))
        out[f], full_budget = by_budget[b], b
    return out, full_budget


def common_questions(samples: dict[int, dict[Question, SampleFidelity]], methods: Iterable[int],
                     tasks: set[int] | None = None) -> list[Question]:
    """The samples every one of ``methods`` has (within ``tasks``), in a fixed order."""
    sets = [set(samples[m]) for m in methods]
    common = set.intersection(*sets) if sets else set()
    return sorted(qn for qn in common if tasks is None or qn[0] in tasks)


def _fmt(lo: float, hi: float, digits: int) -> str:
    return "-" if math.isnan(lo) else f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def _summary_rows(samples, methods, questions, dims, **where) -> list[dict[str, Any]]:
    rows = []
    for m in methods:
        vals = [samples[m][qn] for qn in questions]
        kl = [v.kl for v in vals]
        top1 = [100 * v.top1 for v in vals]
        kl_lo, kl_hi = bootstrap_mean_interval(kl)
        t_lo, t_hi = bootstrap_mean_interval(top1)
        rows.append({
            "method": method_label(dims["methods"], m), "method_id": m, **where,
            "KL": float(np.mean(kl)) if kl else math.nan, "KL lo": kl_lo, "KL hi": kl_hi, "KL 95% CI": _fmt(kl_lo, kl_hi, 4),
            "top-1 %": float(np.mean(top1)) if top1 else math.nan, "top-1 lo": t_lo, "top-1 hi": t_hi,
            "top-1 95% CI": _fmt(t_lo, t_hi, 1),
            "ΔNLL": float(np.mean([v.delta_nll for v in vals])) if vals else math.nan,
            "samples": len(vals), "tokens": sum(v.tokens for v in vals),
        })
    return rows


BOARD_COLUMNS = ["method", "domain", "task", "KL", "KL 95% CI", "top-1 %", "top-1 95% CI", "ΔNLL", "samples", "tokens",
                 "KL lo", "KL hi", "top-1 lo", "top-1 hi", "method_id"]


@dataclass
class FidelityBoard:
    budget: int
    full_budget: int | None
    by_domain: pd.DataFrame  # one row per (method, domain)
    by_task: pd.DataFrame  # one row per (method, task)


def _domains(samples, dims) -> dict[str, set[int]]:
    tasks = dims["tasks"]
    out: dict[str, set[int]] = defaultdict(set)
    for per_q in samples.values():
        for t, _ in per_q:
            out[tasks.get(t, {}).get("domain", "?")].add(t)
    return dict(sorted(out.items()))


def _present(samples, tasks: set[int]) -> list[int]:
    return sorted(m for m, per_q in samples.items() if any(t in tasks for t, _ in per_q))


def fidelity_board(engine, filters: q.Filters, budget: int, dims: dict[str, Any] | None = None) -> FidelityBoard:
    """Mean KL and top-1 agreement with bootstrap intervals per (method, domain) and (method, task) at
    ``budget``, each table on the samples every method in it has, best (lowest KL) first."""
    dims = dims or q.dimensions(engine)
    full_ids = full_cache_ids(dims)
    data = load(engine, filters)
    samples, full_budget = at_budget(data, budget, full_ids)
    if not any(m not in full_ids for m in samples):
        samples = {}
    domain_rows, task_rows = [], []
    for domain, tasks in _domains(samples, dims).items():
        methods = _present(samples, tasks)
        domain_rows += _summary_rows(samples, methods, common_questions(samples, methods, tasks), dims, domain=domain, task="(all)")
        for t in sorted(tasks, key=lambda t: dims["tasks"].get(t, {}).get("name", str(t))):
            here = _present(samples, {t})
            task_rows += _summary_rows(samples, here, common_questions(samples, here, {t}), dims, domain=domain,
                                       task=dims["tasks"].get(t, {}).get("name", f"#{t}"))

    def frame(rows, keys):
        df = pd.DataFrame(rows, columns=BOARD_COLUMNS)
        return df.sort_values([*keys, "KL", "method"], kind="stable").reset_index(drop=True)

    return FidelityBoard(budget, full_budget, frame(domain_rows, ["domain"]), frame(task_rows, ["domain", "task"]))


PAIR_COLUMNS = ["domain", "A", "B", "samples", "KL A", "KL B", "Δ KL (A−B)", "Δ KL 95% CI", "Δ top-1 (pts)",
                "Δ top-1 95% CI", "p (Wilcoxon)", "p (Holm)"]


def _paired(samples, a: int, b: int, questions: list[Question]) -> dict[str, Any]:
    d_kl = [samples[a][qn].kl - samples[b][qn].kl for qn in questions]
    d_top1 = [100 * (samples[a][qn].top1 - samples[b][qn].top1) for qn in questions]
    kl_lo, kl_hi = bootstrap_mean_interval(d_kl)
    t_lo, t_hi = bootstrap_mean_interval(d_top1)
    return {
        "samples": len(questions),
        "KL A": float(np.mean([samples[a][qn].kl for qn in questions])) if questions else math.nan,
        "KL B": float(np.mean([samples[b][qn].kl for qn in questions])) if questions else math.nan,
        "Δ KL (A−B)": float(np.mean(d_kl)) if d_kl else math.nan, "Δ KL lo": kl_lo, "Δ KL hi": kl_hi,
        "Δ KL 95% CI": _fmt(kl_lo, kl_hi, 4),
        "Δ top-1 (pts)": float(np.mean(d_top1)) if d_top1 else math.nan, "Δ top-1 95% CI": _fmt(t_lo, t_hi, 1),
        "p (Wilcoxon)": wilcoxon_p(d_kl),
    }


def fidelity_pairs(engine, filters: q.Filters, budget: int, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """Every pair of methods per domain at ``budget`` on the samples both have: paired mean differences
    of KL and top-1 agreement with bootstrap intervals, Wilcoxon's signed-rank p of the KL differences
    and its Holm adjustment over all the pairs in the table."""
    dims = dims or q.dimensions(engine)
    samples, _ = at_budget(load(engine, filters), budget, full_cache_ids(dims))
    rows = []
    for domain, tasks in _domains(samples, dims).items():
        methods = sorted(_present(samples, tasks), key=lambda m: (method_label(dims["methods"], m), m))
        for a, b in itertools.combinations(methods, 2):
            questions = common_questions(samples, [a, b], tasks)
            rows.append({"domain": domain, "A": method_label(dims["methods"], a), "B": method_label(dims["methods"], b), **_paired(samples, a, b, questions)})
    if not rows:
        return pd.DataFrame(columns=PAIR_COLUMNS)
    for r, adjusted in zip(rows, multiplicity.holm([r["p (Wilcoxon)"] for r in rows])):
        r["p (Holm)"] = adjusted
    df = pd.DataFrame(rows)[PAIR_COLUMNS + ["Δ KL lo", "Δ KL hi"]]
    return df.sort_values(["domain", "p (Wilcoxon)", "A", "B"], kind="stable").reset_index(drop=True)


ABLATION_COLUMNS = ["field", "A", "B", "domain", "budget", "method", "samples", "KL A", "KL B", "Δ KL (B−A)", "Δ KL 95% CI",
                    "p (Wilcoxon)", "p (Holm)"]
#: protocol columns that are not settings
_NOT_SETTINGS = {"id", "spec_hash", "label"}


def protocol_ablations(engine, filters: q.Filters, protocols: list[dict[str, Any]], dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """What one protocol setting changes: for each pair of ``protocols`` (rows of the protocols table)
    that differ in exactly one setting, each method spec (full cache left out) at each budget and in each
    domain measured under both, its KL under A and under B on the samples both have, the paired mean
    difference B−A with its bootstrap interval, Wilcoxon's signed-rank p and Holm over the table."""
    dims = dims or q.dimensions(engine)
    full_ids = set(full_cache_ids(dims))
    protocols = sorted(protocols, key=lambda p: p["id"])
    settings = [k for k in (protocols[0] if protocols else {}) if k not in _NOT_SETTINGS]
    loaded: dict[int, Fidelity] = {}

    def fidelity_under(protocol: dict[str, Any]) -> Fidelity:
        if protocol["id"] not in loaded:  # each protocol's rows read once, however many pairs it is in
            loaded[protocol["id"]] = load(engine, replace(filters, protocols=(protocol["id"],)))
        return loaded[protocol["id"]]

    rows = []
    for a, b in itertools.combinations(protocols, 2):
        changed = [k for k in settings if a[k] != b[k]]
        if len(changed) != 1:
            continue
        da, db = fidelity_under(a), fidelity_under(b)
        for m in sorted(set(da) & set(db) - full_ids, key=lambda m: (method_label(dims["methods"], m), m)):
            for budget in sorted(set(da[m]) & set(db[m])):
                both = {0: {qn: v for qn, v in da[m][budget].items() if qn in db[m][budget]}}
                for domain, tasks in _domains(both, dims).items():
                    questions = sorted(qn for qn in both[0] if qn[0] in tasks)
                    kl_a = [da[m][budget][qn].kl for qn in questions]
                    kl_b = [db[m][budget][qn].kl for qn in questions]
                    d = [y - x for x, y in zip(kl_a, kl_b)]
                    lo, hi = bootstrap_mean_interval(d)
                    rows.append({"field": changed[0], "A": f"#{a['id']}: {a[changed[0]]}", "B": f"#{b['id']}: {b[changed[0]]}",
                                 "domain": domain, "budget": int(budget), "method": method_label(dims["methods"], m),
                                 "samples": len(questions), "KL A": float(np.mean(kl_a)), "KL B": float(np.mean(kl_b)),
                                 "Δ KL (B−A)": float(np.mean(d)), "Δ KL lo": lo, "Δ KL hi": hi, "Δ KL 95% CI": _fmt(lo, hi, 4),
                                 "p (Wilcoxon)": wilcoxon_p(d)})
    if not rows:
        return pd.DataFrame(columns=ABLATION_COLUMNS + ["Δ KL lo", "Δ KL hi"])
    for r, adjusted in zip(rows, multiplicity.holm([r["p (Wilcoxon)"] for r in rows])):
        r["p (Holm)"] = adjusted
    return pd.DataFrame(rows)[ABLATION_COLUMNS + ["Δ KL lo", "Δ KL hi"]]


CURVE_COLUMNS = ["method", "domain", "budget", "KL", "KL lo", "KL hi", "top-1 %", "top-1 lo", "top-1 hi", "samples"]


def fidelity_curves(engine, filters: q.Filters, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """Mean KL and top-1 agreement with bootstrap intervals per (method, domain, budget), full cache
    left out (0 and 100% by construction); each (domain, budget) on the samples its methods all have."""
    dims = dims or q.dimensions(engine)
    full_ids = full_cache_ids(dims)
    data = load(engine, filters)
    rows = []
    for budget in sorted({b for by_budget in data.values() for b in by_budget}):
        samples = {m: by_budget[budget] for m, by_budget in data.items() if m not in full_ids and by_budget.get(budget)}
        for domain, tasks in _domains(samples, dims).items():
            methods = _present(samples, tasks)
            for r in _summary_rows(samples, methods, common_questions(samples, methods, tasks), dims, domain=domain):
                rows.append({**r, "budget": int(budget)})
    df = pd.DataFrame(rows, columns=CURVE_COLUMNS)
    return df.sort_values(["domain", "method", "budget"]).reset_index(drop=True)


SCORECARD_COLUMNS = ["domain", "budget", "method", "claim", "reference", "why fidelity", "KL", "reference KL", "Δ KL",
                     "Δ KL 95% CI", "samples", "test", "p", "p (Holm)", "verdict"]


def _full_accuracy(engine, filters: q.Filters, budget: int, dims: dict[str, Any], tasks: set[int]) -> float | None:
    """Full cache's accuracy (%) on the domain's questions from the generation rows, at its reference
    budget for ``budget``; None when it has none there."""
    full_ids = sorted(full_cache_ids(dims))
    gen = replace(filters, measure=q.MEASURE_GENERATION)
    at = full_reference_budget(engine, gen, budget, full_ids) if full_ids else None
    if at is None:
        return None
    results = cs.results_from_rows(q.question_cells(engine, gen, [at], full_ids))
    full = min(results, key=lambda i: (-len(results[i]), i)) if results else None
    if full is None or not any(c[0] in tasks for c in results[full]):
        return None
    return 100 * float(cs.common_set(results, [full], tasks=tasks).accuracy(full).mean)


def fidelity_scorecard(engine, filters: q.Filters, floor: float = ACCURACY_FLOOR, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """Where accuracy cannot separate methods - full-cache accuracy below ``floor`` % in the (domain,
    budget), or no accuracy results there - each EpiKV-family method against each paper baseline (H2O,
    ThinKV) by fidelity: the claim "closer to the full cache" (lower KL) with the paired mean difference,
    its bootstrap interval and Wilcoxon's signed-rank p, Holm-adjusted over the table. Verdict as on the
    accuracy scorecard: replicates when p (Holm) < 0.05 with lower KL, does not replicate when p (Holm) <
    0.05 with higher KL, else inconclusive; fewer than ``stats.MIN_PROBLEMS`` samples: no verdict."""
    dims = dims or q.dimensions(engine)
    name = lambda m: dims["methods"].get(m, {}).get("name")  # noqa: E731
    full_ids = full_cache_ids(dims)
    data = load(engine, filters)
    rows = []
    for budget in sorted({b for m, by_budget in data.items() if name(m) in REFERENCE_FAMILY for b in by_budget}):
        samples, _ = at_budget(data, budget, full_ids)
        for domain, tasks in _domains(samples, dims).items():
            methods = _present(samples, tasks)
            family = [m for m in methods if name(m) in REFERENCE_FAMILY]
            baselines = [m for m in methods if name(m) in PAPER_BASELINES]
            if not family or not baselines:
                continue
            accuracy = _full_accuracy(engine, filters, budget, dims, tasks)
            if accuracy is not None and accuracy >= floor:
                continue  # accuracy can separate here: the accuracy scorecard judges
            why = "no accuracy results" if accuracy is None else f"full-cache accuracy {accuracy:.1f}% < {floor:g}%"
            for f, b in itertools.product(family, baselines):
                questions = common_questions(samples, [f, b], tasks)
                p = _paired(samples, f, b, questions)
                rows.append({"domain": domain, "budget": int(budget), "method": method_label(dims["methods"], f),
                             "claim": f"closer to full cache than {name(b)}", "reference": method_label(dims["methods"], b), "why fidelity": why,
                             "KL": p["KL A"], "reference KL": p["KL B"], "Δ KL": p["Δ KL (A−B)"],
                             "Δ KL 95% CI": p["Δ KL 95% CI"], "samples": p["samples"], "test": "Wilcoxon signed-rank",
                             "p": p["p (Wilcoxon)"]})
    if not rows:
        return pd.DataFrame(columns=SCORECARD_COLUMNS)
    enough = [r["samples"] >= stats.MIN_PROBLEMS for r in rows]
    for r, ok, p_adj in zip(rows, enough, multiplicity.holm([r["p"] if ok else math.nan for r, ok in zip(rows, enough)])):
        r["p (Holm)"] = p_adj
        if not ok:
            r["verdict"] = stats.TOO_FEW
        elif p_adj < stats.ALPHA:
            r["verdict"] = "replicates" if r["Δ KL"] < 0 else "does not replicate"
        else:
            r["verdict"] = "inconclusive"
    return pd.DataFrame(rows, columns=SCORECARD_COLUMNS)


def markdown(engine, filters: q.Filters = q.Filters()) -> str:
    """The fidelity table of a database as Markdown: per domain, method and budget, the samples, mean KL
    and top-1 agreement with their 95% bootstrap intervals, and delta NLL (docs/fidelity.md)."""
    dims = q.dimensions(engine)
    lines = ["| domain | method | budget | n | mean KL [95% CI] | top-1 % [95% CI] | ΔNLL |", "|---|---|---:|---:|---|---|---:|"]
    budgets = sorted({b for by_budget in load(engine, filters).values() for b in by_budget})
    rows = pd.concat([fidelity_board(engine, filters, b, dims).by_domain.assign(budget=b) for b in budgets], ignore_index=True)
    for _, r in rows.sort_values(["domain", "budget", "KL", "method"], kind="stable").iterrows():
        lines.append(f"| {r['domain']} | {r['method']} | {r['budget']} | {r['samples']} | {r['KL']:.4f} {r['KL 95% CI']} | "
                     f"{r['top-1 %']:.1f} {r['top-1 95% CI']} | {r['ΔNLL']:+.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dashboard.fidelity", description="Print a database's fidelity table (Markdown).")
    p.add_argument("--db", required=True, help="database URL (opened read-only)")
    print(markdown(q.open_readonly(p.parse_args(argv).db)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
