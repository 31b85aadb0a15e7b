"""The data behind each page: SQL aggregates (:mod:`analysis.queries`) turned into tables with
intervals and tests (:mod:`analysis.stats`). Pure functions of an engine and filters, so the pages,
the tests and ``runner/bench/dashboard_load.py`` all compute the same numbers.

Percentages are on the 0-100 scale; differences are percentage points (method minus reference).

Over 500 lines because it is one table function per dashboard page plus the shared helpers
(method labels, full-cache ids, the paper's reference rows) every one of them uses; the heavier
boards live in their own modules (fidelity, head_to_head, signals); verdicts come from analysis.verdicts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd

from kvleague.analysis import common_set as cs
from kvleague.analysis import identity, multiplicity, score_tests, stats, verdicts
from kvleague.analysis import queries as q

# the paper's claims and method families are data (analysis/paper.yaml)
from kvleague.analysis.paper import (
    ACCURACY_CLAIMS,
    CONTEXT_VS_ATTENTION,
    PAPER_BASELINES,
    REFERENCE_FAMILY,
    SPEEDUP_VS_FULL,
)

NOT_MEASURED = stats.NOT_MEASURED
#: the interval column of every comparison: at the family's level (analysis/verdicts.py)
CI = f"Δ {verdicts.LEVEL_TEXT} CI"


def pct(x: float) -> float:
    return x * 100 if x is not None and not (isinstance(x, float) and math.isnan(x)) else math.nan


def fmt_interval(lo: float, hi: float) -> str:
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return "-"
    return f"[{lo:.1f}, {hi:.1f}]"


def full_cache_ids(dims: dict[str, Any]) -> list[int]:
    return [i for i, m in dims["methods"].items() if m["name"] == q.FULL]


def full_reference_budget(engine, filters: q.Filters, budget: int, full_ids: list[int]) -> int | None:
    """The budget whose full-cache rows serve as the reference at ``budget``: the budget where full cache
    has the most rows, ``budget`` itself on a tie (full cache never evicts, so it does not depend on the
    budget, and a sweep may run it at one budget only; fidelity takes it the same way). None: no full
    cache."""
    counts = q.method_budgets(engine, filters, full_ids)
    if not counts:
        return None
    return max(counts, key=lambda b: (counts[b], b == budget, -b))


# ------------------------------------------------------------------------------------------------
# Leaderboard
# ------------------------------------------------------------------------------------------------

LEADERBOARD_COLUMNS = [
    "rank",
    "vs_best",
    "method",
    "domain",
    "task",
    "accuracy",
    "acc_lo",
    "acc_hi",
    "interval",
    "interval_method",
    "delta_full",
    "delta_lo",
    "delta_hi",
    "p_value",
    "test",
    "verdict_full",
    "evicted_share",
    "problems",
    "samples",
    "failed",
    "note",
]


@dataclass
class Leaderboard:
    budget: int
    full_budget: int | None
    by_domain: pd.DataFrame  # one row per (method, domain)
    by_task: pd.DataFrame  # one row per (method, task)
    wide: pd.DataFrame  # methods x domains
    domains: list[str] = field(default_factory=list)
    weighting: str = "problem"


def budget_results(
    engine, filters: q.Filters, budget: int, dims: dict[str, Any]
) -> tuple[cs.Results, int | None, int | None]:
    """Every method's cells at ``budget`` (failed samples included), with full cache taken from its
    reference budget (:func:`full_reference_budget`) under one id. Returns ``(results, full id, full budget)``."""
    full_ids = full_cache_ids(dims)
    full_budget = full_reference_budget(engine, filters, budget, full_ids) if full_ids else None
    others = [i for i in dims["methods"] if i not in full_ids]
    results = cs.results_from_rows(q.question_cells(engine, filters, [budget], others)) if others else {}
    full = (
        cs.results_from_rows(q.question_cells(engine, filters, [full_budget], full_ids))
        if full_budget is not None
        else {}
    )
    full_id = None
    if full:  # several full-cache specs (full has no hyperparameters, so should not happen): keep the biggest
        full_id = min(full, key=lambda i: (-len(full[i]), i))
        results[full_id] = full[full_id]
    return results, full_id, full_budget


def method_label(methods: dict[int, Any], method_id: int) -> str:
    return methods[method_id]["label"] if method_id in methods else f"#{method_id}"


@dataclass
class Slice:
    """One leaderboard table: the results, the tasks it covers and how it pools them. ``shared``: a common set
    of the slice already built; a pair whose two methods have exactly its cells is compared on it (the same
    cells, so the same numbers) instead of building the pair's own."""

    results: cs.Results
    tasks: set[int] | None
    weighting: str = "problem"
    stratum: Callable[[tuple], Any] | None = None
    shared: cs.CommonSet | None = None

    def group(self, methods) -> cs.CommonSet:
        return cs.common_set(self.results, methods, self.tasks, self.weighting, self.stratum)

    def cells_of(self, m: int) -> int:
        if not hasattr(self, "_counts"):
            self._counts: dict[int, int] = {}
        if m not in self._counts:
            self._counts[m] = sum(1 for c in self.results.get(m, {}) if self.tasks is None or c[0] in self.tasks)
        return self._counts[m]

    def pair(self, a: int, b: int) -> cs.CommonSet:
        g = self.shared
        if g is not None and a in g.methods and b in g.methods and self.cells_of(a) == self.cells_of(b) == len(g.cells):
            return g
        return self.group([a, b])


def pair_verdict(
    s: Slice, a: int, b: int, words: tuple[str, str] = ("higher", "lower"), margin: float = 0.0
) -> verdicts.Verdict:
    """``a`` against ``b`` on the questions the two have in the slice (not on the slice's common set, which
    shrinks when a method with fewer cells joins), judged by :func:`analysis.verdicts.judge`. ``margin``: test
    ``difference = -margin`` instead of 0 (a non-inferiority claim)."""
    pair = s.pair(a, b)
    if not pair.cells:
        return verdicts.judge(verdicts.from_comparison(stats.NONE, lambda level: stats.NONE), "accuracy", words)
    c = pair.compare(a, b, verdicts.LEVEL)  # p does not depend on the level; the interval is the verdicts'
    t = verdicts.from_comparison(c, lambda level: c if level == verdicts.LEVEL else pair.compare(a, b, level))
    if not margin:
        return verdicts.judge(t, "accuracy", words)

    def shifted_interval(level: float) -> tuple[float, float]:
        lo, hi = t.interval(level)
        return lo + margin, hi + margin

    shifted = verdicts.Tested(c.diff + margin, stats.shifted_pvalue(c, -margin), c.test, c.n, shifted_interval)
    return verdicts.judge(shifted, "accuracy", words, equivalence=False)


def _best(group: cs.CommonSet) -> int | None:
    """The slice's best method by the point estimate on its common set (ties: the lowest id)."""
    if not group.cells:
        return None
    return max(group.methods, key=lambda m: (group.accuracy(m).mean, -m))


def vs_best_words(s: Slice, group: cs.CommonSet) -> dict[int, str]:
    """Each method against the slice's best, on the questions the two have: "best", "below the best",
    "equivalent within ±5 pts of the best" (tested margin) or "inconclusive"."""
    best = _best(group)
    if best is None:
        return {}
    others = [m for m in group.methods if m != best]
    judged = {m: pair_verdict(s, m, best, ("above the best", "below the best")) for m in others}
    return {best: "best", **{m: v.word + (" of the best" if v.equivalent else "") for m, v in judged.items()}}


def _group_rows(
    s: Slice, group: cs.CommonSet, methods: dict[int, Any], full_id: int | None, domain: str, task: str
) -> list[dict]:
    has_full = full_id is not None and full_id in s.results
    others = [m for m in group.methods if m != full_id]
    vs_full = {m: pair_verdict(s, m, full_id) for m in others} if has_full and full_id is not None else {}
    best = vs_best_words(s, group)
    out = []
    for m_id in group.methods:
        a = group.accuracy(m_id)
        v = vs_full.get(m_id)
        samples = group.total(m_id, "m")
        out.append(
            {
                "method": method_label(methods, m_id),
                "method_id": m_id,
                "domain": domain,
                "task": task,
                "accuracy": pct(a.mean),
                "acc_lo": pct(a.lo),
                "acc_hi": pct(a.hi),
                "interval": fmt_interval(pct(a.lo), pct(a.hi)),
                "interval_method": a.method,
                "delta_full": pct(v.estimate) if v else math.nan,
                "delta_lo": pct(v.lo) if v else math.nan,
                "delta_hi": pct(v.hi) if v else math.nan,
                "p_value": v.p if v else math.nan,
                "test": v.test if v else ("reference" if m_id == full_id else "no full cache"),
                "verdict_full": v.word if v else "-",
                "delta_n": v.n if v else 0,
                "evicted_share": 100.0 * group.total(m_id, "fired") / ok
                if (ok := samples - group.total(m_id, "failed"))
                else math.nan,
                "problems": a.problems,
                "samples": samples,
                "failed": group.total(m_id, "failed"),
                "vs_best": best.get(m_id, "-"),
                "note": stats.TOO_FEW if a.problems < stats.MIN_PROBLEMS else "",
            }
        )
    return out


def leaderboard(
    engine, filters: q.Filters, budget: int, dims: dict[str, Any] | None = None, weighting: str = "problem"
) -> Leaderboard:
    """Methods x domains (and x tasks) at ``budget``. Accuracy (95% Wilson interval) on the cells every method
    in the table has (failed samples counted as wrong); each method against full cache and against the
    table's best on the cells the two have (:func:`pair_verdict`: a method's verdicts do not move when another
    joins); share of samples where eviction fired;
    rank by the point estimate. Linear in the methods: no all-pairs tests."""
    dims = dims or q.dimensions(engine)
    methods, tasks = dims["methods"], dims["tasks"]
    results, full_id, full_budget = budget_results(engine, filters, budget, dims)
    task_of = lambda t: tasks.get(t, {"name": f"#{t}", "domain": "?"})  # noqa: E731
    present: dict[int, set[int]] = defaultdict(set)  # task -> methods with cells there
    for m_id, cells in results.items():
        for c in cells:
            present[c[0]].add(m_id)
    task_rows, domain_rows = [], []
    for t_id in sorted(present, key=lambda t: (task_of(t)["domain"], task_of(t)["name"], t)):
        s = Slice(results, {t_id})
        s.shared = s.group(present[t_id])
        task_rows += _group_rows(s, s.shared, methods, full_id, task_of(t_id)["domain"], task_of(t_id)["name"])
    domains = sorted({task_of(t)["domain"] for t in present})
    pooled = identity.pool(results, tasks)  # a prompt two task rows hold counts once where tasks are pooled
    for d in domains:
        in_domain = {m for t in present if task_of(t)["domain"] == d for m in present[t]}
        s = Slice(pooled, {t for t in present if task_of(t)["domain"] == d}, weighting)
        s.shared = s.group(in_domain)
        domain_rows += _group_rows(s, s.shared, methods, full_id, d, "(all)")
    by_task, by_domain = pd.DataFrame(task_rows), pd.DataFrame(domain_rows)
    for df, group_col in ((by_task, "task"), (by_domain, "domain")):
        if not df.empty:
            df.insert(0, "rank", _rank(df, group_col))
    domains_of: dict[int, set[str]] = defaultdict(set)
    for t, here in present.items():
        for m in here:
            domains_of[m].add(task_of(t)["domain"])
    in_every_domain = [m for m in results if domains_of[m] == set(domains)]
    overall = Slice(pooled, None, weighting, lambda qn: task_of(qn[0])["domain"])
    return Leaderboard(
        budget,
        full_budget,
        by_domain,
        by_task,
        _wide(by_domain, domains, overall, in_every_domain, methods),
        domains,
        weighting,
    )


def _rank(df: pd.DataFrame, group: str) -> pd.Series:
    return df.groupby(group)["accuracy"].rank(ascending=False, method="min").astype("Int64")


def _wide(
    by_domain: pd.DataFrame, domains: list[str], overall: Slice, in_every_domain: list[int], methods: dict[int, Any]
) -> pd.DataFrame:
    """One row per method: the mean accuracy over domains (each domain weighs the same) on the cells
    every method has in every domain, its rank and its comparison with the best there; then per domain the
    accuracy, its interval and the difference from full cache (from the domain's table)."""
    if by_domain.empty:
        return pd.DataFrame(columns=["rank", "vs best", "method", "mean accuracy", "evicted %"])
    group = overall.shared = overall.group(in_every_domain)
    best = vs_best_words(overall, group)
    means = {m: pct(group.accuracy(m).mean) for m in group.methods} if group.cells else {}
    rows = []
    cells: dict[int, dict[str, dict[Any, Any]]] = defaultdict(dict)  # method -> domain -> its row (no pandas per cell)
    for rec in by_domain.to_dict("records"):
        cells[rec["method_id"]].setdefault(rec["domain"], rec)
    for m_id, by_d in cells.items():
        r: dict[str, Any] = {"method": method_label(methods, m_id)}
        fired = samples = 0.0
        for d in domains:
            s = by_d.get(d)
            if s is None:
                r[f"{d} %"], r[f"{d} 95% CI"], r[f"{d} Δ full"] = math.nan, "-", math.nan
                continue
            r[f"{d} %"], r[f"{d} 95% CI"], r[f"{d} Δ full"] = s["accuracy"], s["interval"], s["delta_full"]
            fired += (s["evicted_share"] if not math.isnan(s["evicted_share"]) else 0) * s["samples"] / 100
            samples += s["samples"]
        r["mean accuracy"] = means.get(m_id, math.nan)
        r["vs best"] = best.get(m_id, "-")
        r["evicted %"] = 100 * fired / samples if samples else math.nan
        rows.append(r)
    wide = pd.DataFrame(rows)
    wide.insert(0, "rank", wide["mean accuracy"].rank(ascending=False, method="min").astype("Int64"))
    wide = wide.sort_values(["rank", "method"], na_position="last").reset_index(drop=True)
    cols = (
        ["rank", "vs best", "method", "mean accuracy"]
        + [c for d in domains for c in (f"{d} %", f"{d} 95% CI", f"{d} Δ full")]
        + ["evicted %"]
    )
    return wide[cols]


# ------------------------------------------------------------------------------------------------
# Budget curves
# ------------------------------------------------------------------------------------------------


def _by_budget(rows: list[Any]) -> dict[int, cs.Results]:
    grouped: dict[int, list] = defaultdict(list)
    at = q.QUESTION_CELL_COLUMNS.index("budget")
    for r in rows:
        grouped[int(r[at])].append(r)
    return {b: cs.results_from_rows(rs) for b, rs in grouped.items()}


def _domain_of_cell(tasks: dict[int, Any]) -> Callable[[tuple], str]:
    return lambda c: tasks.get(c[0], {}).get("domain", "?")


def _tasks_in(tasks: dict[int, Any], domain: str) -> set[int]:
    return {t for t, v in tasks.items() if v.get("domain", "?") == domain}


def budget_curves(
    engine, filters: q.Filters, dims: dict[str, Any] | None = None, weighting: str = "problem"
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(curves, full)``: accuracy with interval per (method, domain, budget) for the non-full methods,
    each (domain, budget) on the cells all of them have there; and full cache per domain on its own
    cells at the budget where it has the most samples (full cache does not depend on the budget)."""
    dims = dims or q.dimensions(engine)
    methods, tasks = dims["methods"], dims["tasks"]
    full_ids = set(full_cache_ids(dims))
    domain_of = _domain_of_cell(tasks)
    curves, full_rows = [], []
    full_best: dict[str, tuple] = {}
    for b, results in sorted(_by_budget(q.question_cells(engine, filters)).items()):
        results = identity.pool(results, tasks)
        for d in sorted({domain_of(c) for cells in results.values() for c in cells}):
            here = [m for m in results if any(domain_of(c) == d for c in results[m])]
            group = cs.common_set(
                results, [m for m in here if m not in full_ids], tasks=_tasks_in(tasks, d), weighting=weighting
            )
            for m_id in group.methods:
                a = group.accuracy(m_id)
                curves.append(
                    {
                        "method": method_label(methods, m_id),
                        "domain": d,
                        "budget": int(b),
                        "accuracy": pct(a.mean),
                        "acc_lo": pct(a.lo),
                        "acc_hi": pct(a.hi),
                        "problems": a.problems,
                        "samples": a.samples,
                        "interval_method": a.method,
                    }
                )
            for f in sorted(m for m in here if m in full_ids):
                own = cs.common_set(results, [f], tasks=_tasks_in(tasks, d), weighting=weighting)
                size = (own.total(f, "m"), -b, -f)
                if d not in full_best or size > full_best[d][0]:
                    full_best[d] = (size, b, own.accuracy(f))
    for d, (_, b, a) in sorted(full_best.items()):
        full_rows.append(
            {
                "domain": d,
                "accuracy": pct(a.mean),
                "acc_lo": pct(a.lo),
                "acc_hi": pct(a.hi),
                "budget": int(b),
                "problems": a.problems,
            }
        )
    curves_df = pd.DataFrame(
        curves,
        columns=[
            "method",
            "domain",
            "budget",
            "accuracy",
            "acc_lo",
            "acc_hi",
            "problems",
            "samples",
            "interval_method",
        ],
    )
    curves_df = curves_df.sort_values(["domain", "method", "budget"]).reset_index(drop=True)
    full_df = pd.DataFrame(full_rows, columns=["domain", "accuracy", "acc_lo", "acc_hi", "budget", "problems"])
    return curves_df, full_df


def coincident_lines(curves: pd.DataFrame, value: str, group: str = "domain") -> list[tuple[str, list[str]]]:
    """Per ``group`` (a chart), the methods whose plotted points are the same (budget, ``value``) series: one line
    hides the others, whatever their samples (two methods with equal aggregates but different answers included)."""
    out = []
    for g, sub in curves.groupby(group, sort=True):
        series: dict[tuple, list[str]] = defaultdict(list)
        for m, line in sub.groupby("method", sort=True):
            series[tuple(sorted((int(b), round(float(v), 9)) for b, v in zip(line["budget"], line[value])))].append(
                str(m)
            )
        out += [(str(g), methods) for methods in series.values() if len(methods) > 1]
    return out


# ------------------------------------------------------------------------------------------------
# Replication scorecard
# ------------------------------------------------------------------------------------------------

SCORECARD_COLUMNS = [
    "domain",
    "budget",
    "method",
    "claim",
    "reference",
    "accuracy",
    "reference %",
    "Δ",
    CI,
    "problems",
    "test",
    "p",
    "p (adj.)",
    "verdict",
]


def scorecard(
    engine, filters: q.Filters, margin: float = 5.0, dims: dict[str, Any] | None = None, weighting: str = "problem"
) -> pd.DataFrame:
    """Per domain, budget and EpiKV-family method, one row per claim: better than each paper baseline
    (H2O, ThinKV; score test of difference = 0) and within ``margin`` points of full cache (score test of
    difference = -margin), each on the cells the two have in the (domain, budget), judged by
    :func:`pair_verdict` (the same comparison has the same verdict on every page)."""
    dims = dims or q.dimensions(engine)
    methods, tasks = dims["methods"], dims["tasks"]
    name = lambda i: methods.get(i, {}).get("name")  # noqa: E731
    domain_of = _domain_of_cell(tasks)
    family_budgets = sorted(
        {
            int(b)
            for b, n in q.method_budgets(engine, filters, [i for i in methods if name(i) in REFERENCE_FAMILY]).items()
            if n
        }
    )
    if filters.budgets is not None:
        family_budgets = [b for b in family_budgets if b in filters.budgets]
    rows: list[dict[str, Any]] = []
    for b in family_budgets:
        results, full_id, _ = budget_results(engine, filters, b, dims)
        results = identity.pool(results, tasks)
        for d in sorted({domain_of(c) for cells in results.values() for c in cells}):
            here = sorted(m for m in results if any(domain_of(c) == d for c in results[m]))
            family = [m for m in here if name(m) in REFERENCE_FAMILY]
            if not family:
                continue
            s = Slice(results, _tasks_in(tasks, d), weighting)
            refs = [m for m in here if name(m) in PAPER_BASELINES]
            claims: list[tuple[str, int | None, float]] = [(f"better than {name(r)}", r, 0.0) for r in refs]
            claims.append((f"within {margin:g} pts of full cache", full_id if full_id in here else None, margin / 100))
            for f in family:
                for claim, ref, shift in claims:
                    v = (
                        pair_verdict(s, f, ref, ("replicates", "does not replicate"), shift)
                        if ref is not None
                        else verdicts.judge(verdicts.from_comparison(stats.NONE, lambda lv: stats.NONE), "accuracy")
                    )
                    pair = s.group([f, ref]) if ref is not None else None
                    rows.append(
                        {
                            "domain": d,
                            "budget": int(b),
                            "method": method_label(methods, f),
                            "claim": claim,
                            "reference": method_label(methods, ref) if ref is not None else "-",
                            "accuracy": pct(pair.accuracy(f).mean) if pair and pair.cells else math.nan,
                            "reference %": pct(pair.accuracy(ref).mean)
                            if pair and pair.cells and ref is not None
                            else math.nan,
                            "Δ": pct(v.estimate - shift),
                            CI: fmt_interval(pct(v.lo - shift), pct(v.hi - shift)),
                            "problems": v.n,
                            "test": v.test if v.n else "-",
                            "p": v.p,
                            "p (adj.)": v.p_adjusted,
                            "verdict": v.word,
                        }
                    )
    return pd.DataFrame(rows, columns=SCORECARD_COLUMNS)


def _fmt_measured(a: stats.Accuracy, who: str) -> str:
    return f"{pct(a.mean):.1f}% {fmt_interval(pct(a.lo), pct(a.hi))} ({who}, n={a.problems})"


def _own_accuracy(
    engine, filters: q.Filters, spec_ids: list[int], budget: int, weighting: str = "problem"
) -> tuple[int, stats.Accuracy] | None:
    """The accuracy of the spec (of ``spec_ids``) with the most samples at ``budget``, on its own cells."""
    results = cs.results_from_rows(q.question_cells(engine, filters, [budget], spec_ids))
    if not results:
        return None
    spec = min(results, key=lambda i: (-sum(r[cs.M] for r in results[i].values()), i))
    return spec, cs.common_set(results, [spec], weighting=weighting).accuracy(spec)


def paper_claims(engine, filters: q.Filters, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """The paper's published numbers beside kvleague's measurement on the same task and budget (under the
    model / protocol / decoding filters; the task, domain and budget filters do not apply here), with
    the score test of kvleague's accuracy against the paper's value (the test dual to the Wilson
    interval shown), Holm-adjusted over the accuracy claims."""
    dims = dims or q.dimensions(engine)
    methods, tasks = dims["methods"], dims["tasks"]
    base = replace(filters, domains=None, tasks=None, budgets=None)
    rows = []
    for task_name, budget, who, value, label in ACCURACY_CLAIMS:
        task_ids = tuple(t for t, v in tasks.items() if v["name"] == task_name)
        specs = [i for i, m in methods.items() if m["name"] in who]
        found = _own_accuracy(engine, replace(base, tasks=task_ids), specs, budget) if task_ids and specs else None
        row = {
            "claim": f"{label} on {task_name} at budget {budget}",
            "paper": f"{value:g}%",
            "kvleague": NOT_MEASURED,
            "p vs paper": math.nan,
            "problems": 0,
            "_n": 0,
        }
        if found is not None:
            spec, a = found
            row.update(
                {
                    "kvleague": _fmt_measured(a, methods[spec]["label"]),
                    "problems": a.problems,
                    "_n": a.problems,
                    "p vs paper": score_tests.two_sided_p(score_tests.wilson_z(a.mean, a.n_effective, value / 100)),
                }
            )
        rows.append(row)
    adjusted = multiplicity.holm([r["p vs paper"] for r in rows])
    for r, p_adj in zip(rows, adjusted):
        n = r.pop("_n")
        r["p vs paper (Holm)"] = p_adj
        r["verdict"] = (
            NOT_MEASURED
            if not n
            else stats.TOO_FEW
            if n < stats.MIN_PROBLEMS
            else "differs from the paper"
            if p_adj < stats.ALPHA
            else "consistent with the paper"
        )

    cost = q.cost_rows(engine, replace(base), by_domain=True)
    full_ids = set(full_cache_ids(dims))
    family = {i for i, m in methods.items() if m["name"] in REFERENCE_FAMILY}
    full_cost = {(c["budget"], c["domain"]): c for c in cost if c["method_spec_id"] in full_ids}
    best_speed: tuple[float, str] | None = None
    best_ctx: tuple[float, str] | None = None
    full_any = defaultdict(list)
    for c in cost:
        if c["method_spec_id"] in full_ids:
            full_any[c["domain"]].append(c)
    for c in cost:
        if c["method_spec_id"] not in family:
            continue
        ref = full_cost.get((c["budget"], c["domain"])) or (
            max(full_any[c["domain"]], key=lambda x: x["samples"]) if full_any[c["domain"]] else None
        )
        if ref is None:
            continue
        where = f"{methods[c['method_spec_id']]['label']}, {c['domain']}, budget {c['budget']}"
        if c["tokens_per_second"] and ref["tokens_per_second"]:
            s = float(c["tokens_per_second"]) / float(ref["tokens_per_second"])
            if best_speed is None or s > best_speed[0]:
                best_speed = (s, where)
        if c["peak_cache_entries"] and ref["peak_cache_entries"]:
            x = float(ref["peak_cache_entries"]) / float(c["peak_cache_entries"])
            if best_ctx is None or x > best_ctx[0]:
                best_ctx = (x, where)
    no_test = {"p vs paper": math.nan, "p vs paper (Holm)": math.nan, "verdict": "-", "problems": 0}
    rows.append(
        {
            "claim": "decoding speed vs full cache (tokens/s), best setting",
            "paper": f"up to {SPEEDUP_VS_FULL:g}x",
            "kvleague": f"{best_speed[0]:.2f}x ({best_speed[1]}; sweep timings, not a speed benchmark: batch "
            "composition and machine load not controlled, not comparable with the systems benchmark)"
            if best_speed
            else NOT_MEASURED,
            **no_test,
        }
    )
    rows.append(
        {
            "claim": "feasible context in the same KV memory (full / method peak cache entries)",
            "paper": f"{CONTEXT_VS_ATTENTION:g}x",
            "kvleague": f"{best_ctx[0]:.1f}x ({best_ctx[1]}; peak cache entries at a fixed budget, which the budget "
            "sets: not a feasible-context measurement, see the systems benchmark's row)"
            if best_ctx
            else NOT_MEASURED,
            **no_test,
        }
    )
    rows += [{**r, **no_test} for r in _systems_claims(latest_benchmark_runs(q.benchmark_rows(engine)))]
    return pd.DataFrame(
        rows, columns=["claim", "paper", "kvleague", "p vs paper", "p vs paper (Holm)", "verdict", "problems"]
    )


def _ratio_text(fig: dict[str, Any]) -> str:
    details = fig["details"] or {}
    if details.get("undetermined"):  # both methods fit the search cap: the ratio says nothing
        return f"undetermined: both reached the search cap (budget {fig['budget']})"
    return f"{'>= ' if details.get('at_least') else ''}{fig['value']:.2f}x at budget {fig['budget']}"


def setup_text(fig: dict[str, Any]) -> str:
    """The set-up a speed figure was measured under: model, backend, batch, machine, when, quick or not. Figures of
    different set-ups are never one claim; the reader compares these."""
    config = fig.get("config") or {}
    batch = config.get("batch_size", config.get("batch_sizes", "-"))
    quick = "quick run" if config.get("quick") else "full run" if "quick" in config else "mode not recorded"
    return (
        f"model {fig.get('model') or '-'}, backend {config.get('backend', config.get('attn_implementation', '-'))}, "
        f"batch {batch}, {_hardware(fig)}, measured {fig.get('created_at') or '-'}, {quick}"
    )


def _systems_claims(figures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The claims row for each systems-benchmark ratio (epikv over a reference), from the latest run:
    the largest ratio over the budgets measured."""
    claims = (
        ("decoding speed epikv / full", "speed_ratio", "full", f"up to {SPEEDUP_VS_FULL:g}x"),
        ("decoding speed epikv / h2o", "speed_ratio", "h2o", "-"),
        ("feasible context epikv / h2o", "feasible_context_ratio", "h2o", f"{CONTEXT_VS_ATTENTION:g}x"),
    )
    rows = []
    for label, metric, reference, paper in claims:
        found = [
            f
            for f in figures
            if (f["metric"], f["method"], f["reference"]) == (metric, "epikv", reference) and f["value"] is not None
        ]
        best = max(found, key=lambda f: f["value"], default=None)
        rows.append(
            {
                "claim": f"{label} (systems benchmark)",
                "paper": paper,
                "kvleague": f"{_ratio_text(best)} [{setup_text(best)}]" if best else NOT_MEASURED,
            }
        )
    return rows


# ------------------------------------------------------------------------------------------------
# Systems benchmarks
# ------------------------------------------------------------------------------------------------

SYSTEMS_COLUMNS = [
    "benchmark",
    "method",
    "budget",
    "metric",
    "value",
    "unit",
    "reference",
    "note",
    "model",
    "hardware",
    "measured at",
]


def latest_benchmark_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The figures of the newest run of each benchmark (``rows`` come newest run first): an older run
    measured other settings or code, so its figures are not mixed in."""
    newest: dict[str, str] = {}
    for r in rows:
        newest.setdefault(r["benchmark"], r["run_id"])
    return [r for r in rows if newest[r["benchmark"]] == r["run_id"]]


def _hardware(r: dict[str, Any]) -> str:
    if r["hostname"] is None:
        return "-"
    gpu = f"{r['gpu_count']}x {r['gpu_name']}, CUDA {r['cuda_version']}" if r["gpu_count"] else "no GPU"
    return f"{r['hostname']} ({r['platform']}; {gpu})"


def _note(details: dict[str, Any] | None) -> str:
    details = details or {}
    if details.get("undetermined"):
        return "undetermined: both reached the search cap"
    if details.get("at_least"):
        return "at least: reached the search cap"
    return ""


def systems_benchmarks(engine) -> pd.DataFrame:
    """One row per figure of the latest run of each systems benchmark, with the machine it ran on."""
    rows = [
        {
            "benchmark": r["benchmark"],
            "method": r["method"],
            "budget": r["budget"],
            "metric": r["metric"],
            "value": r["value"],
            "unit": r["unit"],
            "reference": r["reference"],
            "note": _note(r["details"]),
            "model": r["model"],
            "hardware": _hardware(r),
            "measured at": r["created_at"],
        }
        for r in latest_benchmark_runs(q.benchmark_rows(engine))
    ]
    df = pd.DataFrame(rows, columns=SYSTEMS_COLUMNS)
    return df.astype({"budget": "Int64", "value": "float64"})


# ------------------------------------------------------------------------------------------------
# Cost
# ------------------------------------------------------------------------------------------------


def cost(engine, filters: q.Filters, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """Per (method, budget): throughput, latency, memory, method overhead, accuracy with interval (on
    the method's own problems, failed samples counted as wrong, questions as the unit) and whether the point is on the accuracy-vs-peak-KV-memory Pareto front."""
    dims = dims or q.dimensions(engine)
    methods = dims["methods"]
    rows = q.cost_rows(engine, filters)
    per_budget = _by_budget(q.question_cells(engine, filters))
    out = []
    for r in rows:
        results = per_budget.get(int(r["budget"]), {})
        m_id = r["method_spec_id"]
        a = (
            cs.common_set(results, [m_id]).accuracy(m_id)
            if m_id in results
            else stats.accuracy(stats.unweighted([], 1))
        )
        model_s = float(r["model_seconds_sum"] or 0)
        tps_lo, tps_hi = _mean_interval(
            r["tokens_per_second"], r["tokens_per_second_sq"], int(r["tokens_per_second_n"])
        )
        over_lo, over_hi = _ratio_interval(
            float(r["method_seconds_sum"] or 0),
            model_s,
            float(r["method_seconds_sq_sum"] or 0),
            float(r["method_model_seconds_sum"] or 0),
            float(r["model_seconds_sq_sum"] or 0),
            int(r["samples"]),
        )
        out.append(
            {
                "method": methods.get(r["method_spec_id"], {}).get("label", f"#{r['method_spec_id']}"),
                "budget": int(r["budget"]),
                "samples": int(r["samples"]),
                "accuracy": pct(a.mean),
                "acc_lo": pct(a.lo),
                "acc_hi": pct(a.hi),
                "tokens/s": _f(r["tokens_per_second"]),
                "tokens/s lo": tps_lo,
                "tokens/s hi": tps_hi,
                "ms/token": _f(r["seconds_per_token"], 1000),
                "ms/token p95": _f(r["seconds_per_token_p95"], 1000),
                "prefill s": _f(r["prefill_seconds"]),
                "peak KV MiB": _f(r["peak_kv_bytes"], 1 / 2**20),
                "peak KV MiB (max)": _f(r["peak_kv_bytes_max"], 1 / 2**20),
                "peak memory MiB (max)": _f(r["peak_memory_bytes_max"], 1 / 2**20),
                "peak cache entries": _f(r["peak_cache_entries"]),
                "method ms/sample": _f(r["method_seconds"], 1000),
                "selection ms/sample": _f(r["selection_seconds"], 1000),
                "method overhead %": 100 * float(r["method_seconds_sum"]) / model_s
                if r["method_seconds_sum"] is not None and model_s > 0
                else math.nan,
                "overhead lo": over_lo,
                "overhead hi": over_hi,
            }
        )
    df = pd.DataFrame(out)
    if df.empty:
        return df
    df = df.sort_values(["method", "budget"]).reset_index(drop=True)
    pts = [(c, a) for c, a in zip(df["peak KV MiB"], df["accuracy"])]
    ok = [not (math.isnan(c) or math.isnan(a)) for c, a in pts]
    front = stats.pareto_front([p for p, good in zip(pts, ok) if good])
    it = iter(front)
    df["pareto"] = [next(it) if good else False for good in ok]
    return df


def _t95(n: int) -> float:
    from scipy import stats as scipy_stats

    return float(scipy_stats.t.ppf(0.975, n - 1))


def _mean_interval(mean: Any, mean_sq: Any, n: int) -> tuple[float, float]:
    """95% t interval of a mean over n samples from the mean and the mean of squares (NaN below 2)."""
    if mean is None or mean_sq is None or n < 2:
        return math.nan, math.nan
    mean, sd = float(mean), math.sqrt(max(0.0, float(mean_sq) - float(mean) ** 2) * n / (n - 1))
    half = _t95(n) * sd / math.sqrt(n)
    return mean - half, mean + half


def _ratio_interval(sm: float, st: float, smm: float, smt: float, stt: float, n: int) -> tuple[float, float]:
    """95% interval, in %, of the ratio of sums sum(m) / sum(t) over n samples (the method overhead): the
    ratio estimator's delta-method standard error, sqrt(sum((m - R t)^2) / (n (n - 1))) / mean(t)."""
    if n < 2 or st <= 0:
        return math.nan, math.nan
    ratio = sm / st
    se = math.sqrt(max(0.0, smm - 2 * ratio * smt + ratio**2 * stt) / (n * (n - 1))) / (st / n)
    half = _t95(n) * se
    return 100 * (ratio - half), 100 * (ratio + half)


def _f(x: Any, scale: float = 1.0) -> float:
    return float(x) * scale if x is not None else math.nan


# ------------------------------------------------------------------------------------------------
# Samples
# ------------------------------------------------------------------------------------------------


def repetition_share(text: str | None, n: int = 4) -> float:
    """Share of repeated word n-grams: near 1 for a generation stuck in a loop."""
    words = (text or "").split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if len(grams) < 4:
        return 0.0
    return 1 - len(set(grams)) / len(grams)


def failure_flag(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return "failed"
    if not (row.get("completion") or "").strip():
        return "empty"
    if repetition_share(row.get("completion")) >= 0.5:
        return "loop"
    if row.get("stop_reason") in ("length", "max_new_tokens"):
        return "truncated"
    return ""


def samples(
    engine, filters: q.Filters, task_id: int, sample_id: str, budget: int | None, dims: dict[str, Any] | None = None
) -> pd.DataFrame:
    dims = dims or q.dimensions(engine)
    methods = dims["methods"]
    rows = q.sample_rows(engine, filters, task_id, sample_id, budget)
    out = []
    for r in rows:
        out.append(
            {
                "method": methods.get(r["method_spec_id"], {}).get("label", f"#{r['method_spec_id']}"),
                "budget": r["budget"],
                "sample_index": r["sample_index"],
                "seed": r["seed"],
                "status": r["status"],
                "correct": r["correct"],
                "extracted": r["extracted"],
                "stop_reason": r["stop_reason"],
                "flag": failure_flag(r),
                **{c: r[c] for c in q.METRIC_COLUMNS},  # the engine's per-sample metrics, as stored
                "completion": r["completion"],
                "error": r["error"],
                "sweep_id": r["sweep_id"],
                "id": r["id"],
            }
        )
    return pd.DataFrame(out)
