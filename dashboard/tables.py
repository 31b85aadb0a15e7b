"""The data behind each page: SQL aggregates (:mod:`dashboard.queries`) turned into tables with
intervals and tests (:mod:`dashboard.stats`). Pure functions of an engine and filters, so the pages,
the tests and ``benchmarks/dashboard_load.py`` all compute the same numbers.

Percentages are on the 0-100 scale; differences are percentage points (method minus reference).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import pandas as pd

from dashboard import queries as q
from dashboard import stats

#: the published claims the scorecard sets measurements against (accuracy in %)
PAPER_ACCURACY_CLAIMS = (
    # (task, budget, who, paper value, label)
    ("math500", 4096, ("epikv",), 72.0, "EpiKV"),
    ("math500", 4096, ("thinkv",), 71.0, "ThinKV"),
    ("math500", 4096, ("h2o",), 67.0, "H2O"),
    ("math500", 4096, (q.FULL,), 75.0, "full cache"),
    ("aime24", 8192, ("lag_kv",), 37.0, "lag-normalised KV"),
    ("aime24", 8192, q.ATTENTION_BASELINES, 33.0, "best attention baseline"),
    ("aime24", 8192, (q.FULL,), 43.0, "full cache"),
)
PAPER_SPEEDUP = 2.8
PAPER_CONTEXT = 16.0
NOT_MEASURED = "not measured yet"


def pct(x: float) -> float:
    return x * 100 if x is not None and not (isinstance(x, float) and math.isnan(x)) else math.nan


def fmt_interval(lo: float, hi: float) -> str:
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return "-"
    return f"[{lo:.1f}, {hi:.1f}]"


def _acc(hist: Iterable[tuple[int, int, int]]) -> stats.Accuracy:
    return stats.accuracy_interval(list(hist))


def _cmp(pairs: Iterable[tuple[int, int, int, int, int]]) -> stats.Comparison:
    return stats.compare_paired(list(pairs))


def _full_ids(dims: dict[str, Any]) -> list[int]:
    return [i for i, m in dims["methods"].items() if m["name"] == q.FULL]


def full_reference_budget(engine, filters: q.Filters, budget: int, full_ids: list[int]) -> int | None:
    """The budget whose full-cache rows serve as the reference at ``budget``: the same budget when the
    sweep stored full cache there (sweeps cross every method with every budget), else the budget where
    full cache has the most rows (full cache does not depend on the budget). None: no full cache."""
    counts = q.method_budgets(engine, filters, full_ids)
    if not counts:
        return None
    if budget in counts:
        return budget
    return max(counts, key=lambda b: (counts[b], -b))


# ------------------------------------------------------------------------------------------------
# Leaderboard
# ------------------------------------------------------------------------------------------------

LEADERBOARD_COLUMNS = [
    "rank", "method", "domain", "task", "accuracy", "acc_lo", "acc_hi", "interval", "interval_method",
    "delta_full", "delta_lo", "delta_hi", "p_value", "test", "evicted_share", "problems", "samples", "failed",
]


@dataclass
class Leaderboard:
    budget: int
    full_budget: int | None
    by_domain: pd.DataFrame  # one row per (method, domain)
    by_task: pd.DataFrame  # one row per (method, task)
    wide: pd.DataFrame  # methods x domains
    domains: list[str] = field(default_factory=list)


def _rank(df: pd.DataFrame, group: str | None) -> pd.Series:
    if df.empty:
        return pd.Series(dtype="Int64")
    if group is None:
        return df["accuracy"].rank(ascending=False, method="min").astype("Int64")
    return df.groupby(group)["accuracy"].rank(ascending=False, method="min").astype("Int64")


def leaderboard(engine, filters: q.Filters, budget: int, dims: dict[str, Any] | None = None) -> Leaderboard:
    """Methods x domains (and x tasks) at ``budget``: accuracy with a 95% interval, difference from full
    cache with a paired test, share of samples where eviction fired, rank."""
    dims = dims or q.dimensions(engine)
    methods, tasks = dims["methods"], dims["tasks"]
    hist = q.problem_hist(engine, filters, [budget])
    full_ids = _full_ids(dims)
    present = sorted({h["method_spec_id"] for h in hist})
    present_full = [i for i in full_ids if i in present] or full_ids
    full_budget = full_reference_budget(engine, filters, budget, full_ids) if full_ids else None
    pairs: list[dict[str, Any]] = []
    if full_budget is not None:
        others = [i for i in present if i not in full_ids]
        pairs = q.paired_hist(engine, filters, others, present_full if full_budget == budget else full_ids, [budget],
                              None if full_budget == budget else full_budget)
        # several full-cache specs (should not happen: full has no hyperparameters): keep the biggest
        if len({p["b_method"] for p in pairs}) > 1:
            size: dict[int, int] = defaultdict(int)
            for p in pairs:
                size[p["b_method"]] += p["problems"]
            keep = max(size, key=size.get)
            pairs = [p for p in pairs if p["b_method"] == keep]
    failed = q.failed_counts(engine, filters, [budget])

    acc_task: dict[tuple[int, int], list] = defaultdict(list)
    fired_task: dict[tuple[int, int], int] = defaultdict(int)
    for h in hist:
        key = (h["method_spec_id"], h["task_id"])
        acc_task[key].append((h["k"], h["m"], h["problems"]))
        fired_task[key] += int(h["fired"] or 0)
    pair_task: dict[tuple[int, int], list] = defaultdict(list)
    for p in pairs:
        pair_task[(p["a_method"], p["task_id"])].append((p["k_a"], p["m_a"], p["k_b"], p["m_b"], p["problems"]))
    fail_task: dict[tuple[int, int], int] = defaultdict(int)
    for f in failed:
        fail_task[(f["method_spec_id"], f["task_id"])] += int(f["failed"])

    def row(method_id: int, domain: str, task: str, hist_rows: list, fired: int, pair_rows: list, n_failed: int) -> dict:
        a = _acc(hist_rows)
        c = _cmp(pair_rows) if pair_rows else None
        return {
            "method": methods[method_id]["label"] if method_id in methods else f"#{method_id}",
            "method_id": method_id,
            "domain": domain,
            "task": task,
            "accuracy": pct(a.mean),
            "acc_lo": pct(a.lo),
            "acc_hi": pct(a.hi),
            "interval": fmt_interval(pct(a.lo), pct(a.hi)),
            "interval_method": a.method,
            "delta_full": pct(c.diff) if c else math.nan,
            "delta_lo": pct(c.lo) if c else math.nan,
            "delta_hi": pct(c.hi) if c else math.nan,
            "p_value": c.pvalue if c else math.nan,
            "test": c.test if c else ("reference" if method_id in full_ids else "no full cache"),
            "paired_problems": c.n if c else 0,
            "evicted_share": 100.0 * fired / a.samples if a.samples else math.nan,
            "problems": a.problems,
            "samples": a.samples,
            "failed": n_failed,
        }

    task_rows, domain_rows = [], []
    by_domain_keys: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for (m_id, t_id) in sorted(acc_task, key=lambda k: (methods.get(k[0], {}).get("label", ""), k[1])):
        t = tasks.get(t_id, {"name": f"#{t_id}", "domain": "?"})
        task_rows.append(row(m_id, t["domain"], t["name"], acc_task[(m_id, t_id)], fired_task[(m_id, t_id)],
                             pair_task.get((m_id, t_id), []), fail_task.get((m_id, t_id), 0)))
        by_domain_keys[(m_id, t["domain"])].append((m_id, t_id))
    for (m_id, domain), keys in sorted(by_domain_keys.items(), key=lambda kv: (methods.get(kv[0][0], {}).get("label", ""), kv[0][1])):
        domain_rows.append(row(
            m_id, domain, "(all)",
            [x for k in keys for x in acc_task[k]], sum(fired_task[k] for k in keys),
            [x for k in keys for x in pair_task.get(k, [])], sum(fail_task.get(k, 0) for k in keys),
        ))
    by_task = pd.DataFrame(task_rows)
    by_domain = pd.DataFrame(domain_rows)
    for df, group in ((by_task, "task"), (by_domain, "domain")):
        if not df.empty:
            df.insert(0, "rank", _rank(df, group))
    domains = sorted(by_domain["domain"].unique()) if not by_domain.empty else []
    return Leaderboard(budget, full_budget, by_domain, by_task, _wide(by_domain, domains), domains)


def _wide(by_domain: pd.DataFrame, domains: list[str]) -> pd.DataFrame:
    """One row per method: mean accuracy over domains (each domain weighs the same), rank by it, then
    per domain the accuracy, its interval and the difference from full cache."""
    if by_domain.empty:
        return pd.DataFrame(columns=["rank", "method", "mean accuracy", "evicted %"])
    rows = []
    for method, g in by_domain.groupby("method", sort=False):
        r: dict[str, Any] = {"method": method}
        accs = []
        fired = samples = 0.0
        for d in domains:
            sub = g[g["domain"] == d]
            if sub.empty:
                r[f"{d} %"] = math.nan
                r[f"{d} 95% CI"] = "-"
                r[f"{d} Δ full"] = math.nan
                continue
            s = sub.iloc[0]
            accs.append(s["accuracy"])
            r[f"{d} %"] = s["accuracy"]
            r[f"{d} 95% CI"] = s["interval"]
            r[f"{d} Δ full"] = s["delta_full"]
            fired += (s["evicted_share"] if not math.isnan(s["evicted_share"]) else 0) * s["samples"] / 100
            samples += s["samples"]
        r["mean accuracy"] = sum(accs) / len(accs) if len(accs) == len(domains) else math.nan
        r["evicted %"] = 100 * fired / samples if samples else math.nan
        rows.append(r)
    wide = pd.DataFrame(rows)
    wide.insert(0, "rank", wide["mean accuracy"].rank(ascending=False, method="min").astype("Int64"))
    wide = wide.sort_values(["rank", "method"], na_position="last").reset_index(drop=True)
    cols = ["rank", "method", "mean accuracy"] + [c for d in domains for c in (f"{d} %", f"{d} 95% CI", f"{d} Δ full")] + ["evicted %"]
    return wide[cols]


# ------------------------------------------------------------------------------------------------
# Budget curves
# ------------------------------------------------------------------------------------------------


def budget_curves(engine, filters: q.Filters, dims: dict[str, Any] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(curves, full)``: accuracy with interval per (method, domain, budget) for the non-full methods,
    and full cache per domain (pooled over the budget where full has the most rows)."""
    dims = dims or q.dimensions(engine)
    methods, tasks = dims["methods"], dims["tasks"]
    hist = q.problem_hist(engine, filters)
    full_ids = set(_full_ids(dims))
    acc: dict[tuple[int, str, int], list] = defaultdict(list)
    for h in hist:
        d = tasks.get(h["task_id"], {}).get("domain", "?")
        acc[(h["method_spec_id"], d, h["budget"])].append((h["k"], h["m"], h["problems"]))
    curves, full_rows = [], []
    full_by_domain: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for (m_id, d, b), rows in acc.items():
        if m_id in full_ids:
            full_by_domain[d][b].extend(rows)
            continue
        a = _acc(rows)
        curves.append({"method": methods.get(m_id, {}).get("label", f"#{m_id}"), "domain": d, "budget": int(b),
                       "accuracy": pct(a.mean), "acc_lo": pct(a.lo), "acc_hi": pct(a.hi), "problems": a.problems,
                       "samples": a.samples, "interval_method": a.method})
    for d, per_budget in full_by_domain.items():
        b = max(per_budget, key=lambda x: (sum(r[2] * r[1] for r in per_budget[x]), -x))
        a = _acc(per_budget[b])
        full_rows.append({"domain": d, "accuracy": pct(a.mean), "acc_lo": pct(a.lo), "acc_hi": pct(a.hi), "budget": int(b),
                          "problems": a.problems})
    curves_df = pd.DataFrame(curves, columns=["method", "domain", "budget", "accuracy", "acc_lo", "acc_hi", "problems", "samples", "interval_method"])
    curves_df = curves_df.sort_values(["domain", "method", "budget"]).reset_index(drop=True)
    full_df = pd.DataFrame(full_rows, columns=["domain", "accuracy", "acc_lo", "acc_hi", "budget", "problems"])
    return curves_df, full_df


# ------------------------------------------------------------------------------------------------
# Replication scorecard
# ------------------------------------------------------------------------------------------------


def scorecard(engine, filters: q.Filters, margin: float = 5.0, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """Per domain, budget and EpiKV-family method: against the best attention-based baseline (claim:
    better; verdict from the paired test) and against full cache (claim: within ``margin`` points;
    verdict from the difference's interval)."""
    dims = dims or q.dimensions(engine)
    methods, tasks = dims["methods"], dims["tasks"]
    hist = q.problem_hist(engine, filters)
    present = {h["method_spec_id"] for h in hist}
    family = sorted(i for i in present if methods.get(i, {}).get("name") in q.REFERENCE_FAMILY)
    baselines = sorted(i for i in present if methods.get(i, {}).get("name") in q.ATTENTION_BASELINES)
    full_ids = _full_ids(dims)
    if not family:
        return pd.DataFrame()
    domain_of = {t: v["domain"] for t, v in tasks.items()}
    acc: dict[tuple[int, str, int], list] = defaultdict(list)
    for h in hist:
        acc[(h["method_spec_id"], domain_of.get(h["task_id"], "?"), h["budget"])].append((h["k"], h["m"], h["problems"]))
    budgets = sorted({h["budget"] for h in hist if h["method_spec_id"] in family})
    domains = sorted({domain_of.get(h["task_id"], "?") for h in hist})
    # the best attention baseline per (domain, budget), by accuracy; only those are paired with the family
    best_of: dict[tuple[str, int], int | None] = {}
    base_accs: dict[tuple[str, int], dict[int, stats.Accuracy]] = {}
    for d in domains:
        for b in budgets:
            base_accs[(d, b)] = {i: _acc(acc[(i, d, b)]) for i in baselines if acc.get((i, d, b))}
            ba = base_accs[(d, b)]
            best_of[(d, b)] = max(ba, key=lambda i: (ba[i].mean, -i)) if ba else None
    partners = sorted({i for i in best_of.values() if i is not None} | {i for i in full_ids if i in present})
    pairs = q.paired_hist(engine, filters, family, partners, budgets)
    # full cache missing at some budget: pair with the budget where it has the most rows
    full_pairs_budgets = {(p["budget"]) for p in pairs if p["b_method"] in full_ids}
    missing = [b for b in budgets if b not in full_pairs_budgets]
    if missing and full_ids:
        fb = full_reference_budget(engine, filters, -1, full_ids)
        if fb is not None:
            pairs += q.paired_hist(engine, filters, family, full_ids, missing, fb)
    pair_map: dict[tuple[int, int, str, int], list] = defaultdict(list)
    for p in pairs:
        pair_map[(p["a_method"], p["b_method"], domain_of.get(p["task_id"], "?"), p["budget"])].append(
            (p["k_a"], p["m_a"], p["k_b"], p["m_b"], p["problems"]))
    rows = []
    for d in domains:
        for b in budgets:
            base_acc, best = base_accs[(d, b)], best_of[(d, b)]
            for f in family:
                if not acc.get((f, d, b)):
                    continue
                a = _acc(acc[(f, d, b)])
                r: dict[str, Any] = {"domain": d, "budget": int(b), "method": methods[f]["label"], "accuracy": pct(a.mean),
                                     "interval": fmt_interval(pct(a.lo), pct(a.hi)), "problems": a.problems}
                if best is not None:
                    c = _cmp(pair_map.get((f, best, d, b), []))
                    r.update({"best baseline": methods[best]["label"], "baseline %": pct(base_acc[best].mean),
                              "Δ baseline": pct(c.diff), "Δ baseline CI": fmt_interval(pct(c.lo), pct(c.hi)),
                              "p baseline": c.pvalue, "verdict vs baseline": stats.verdict_superior(c)})
                else:
                    r.update({"best baseline": "-", "baseline %": math.nan, "Δ baseline": math.nan, "Δ baseline CI": "-",
                              "p baseline": math.nan, "verdict vs baseline": NOT_MEASURED})
                full_key = next(((f, i, d, b) for i in full_ids if pair_map.get((f, i, d, b))), None)
                if full_key is not None:
                    c = _cmp(pair_map[full_key])
                    full_acc = _acc([(x[2], x[3], x[4]) for x in pair_map[full_key]])
                    r.update({"full %": pct(full_acc.mean),
                              "Δ full": pct(c.diff), "Δ full CI": fmt_interval(pct(c.lo), pct(c.hi)), "p full": c.pvalue,
                              f"verdict vs full (within {margin:g} pts)": stats.verdict_noninferior(c, margin / 100)})
                else:
                    r.update({"full %": math.nan, "Δ full": math.nan, "Δ full CI": "-", "p full": math.nan,
                              f"verdict vs full (within {margin:g} pts)": NOT_MEASURED})
                rows.append(r)
    return pd.DataFrame(rows)


def _fmt_measured(a: stats.Accuracy, who: str) -> str:
    return f"{pct(a.mean):.1f}% {fmt_interval(pct(a.lo), pct(a.hi))} ({who}, n={a.problems})"


def paper_claims(engine, filters: q.Filters, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """The paper's published numbers beside kvleague's measurement on the same task and budget (under the
    model / protocol / decoding filters; the task, domain and budget filters do not apply here)."""
    dims = dims or q.dimensions(engine)
    methods, tasks = dims["methods"], dims["tasks"]
    base = replace(filters, domains=None, tasks=None, budgets=None)
    rows = []
    hist_cache: dict[tuple[str, int], list] = {}
    for task_name, budget, who, value, label in PAPER_ACCURACY_CLAIMS:
        task_ids = tuple(t for t, v in tasks.items() if v["name"] == task_name)
        measured, inside, n = NOT_MEASURED, "-", 0
        if task_ids:
            key = (task_name, budget)
            if key not in hist_cache:
                hist_cache[key] = q.problem_hist(engine, replace(base, tasks=task_ids), [budget])
            by_method: dict[int, list] = defaultdict(list)
            for h in hist_cache[key]:
                if methods.get(h["method_spec_id"], {}).get("name") in who:
                    by_method[h["method_spec_id"]].append((h["k"], h["m"], h["problems"]))
            if by_method:
                accs = {i: _acc(v) for i, v in by_method.items()}
                best = max(accs, key=lambda i: (accs[i].mean, -i))
                a = accs[best]
                measured = _fmt_measured(a, methods[best]["label"])
                inside = "yes" if a.lo * 100 <= value <= a.hi * 100 else "no"
                n = a.problems
        rows.append({"claim": f"{label} on {task_name} at budget {budget}", "paper": f"{value:g}%", "kvleague": measured,
                     "paper value inside 95% CI": inside, "problems": n})

    cost = q.cost_rows(engine, replace(base), by_domain=True)
    full_ids = set(_full_ids(dims))
    family = {i for i, m in methods.items() if m["name"] in q.REFERENCE_FAMILY}
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
        ref = full_cost.get((c["budget"], c["domain"])) or (max(full_any[c["domain"]], key=lambda x: x["samples"]) if full_any[c["domain"]] else None)
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
    rows.append({"claim": "decoding speed vs full cache (tokens/s), best setting", "paper": f"up to {PAPER_SPEEDUP:g}x",
                 "kvleague": f"{best_speed[0]:.2f}x ({best_speed[1]})" if best_speed else NOT_MEASURED,
                 "paper value inside 95% CI": "-", "problems": 0})
    rows.append({"claim": "feasible context in the same KV memory (full / method peak cache entries)",
                 "paper": f"{PAPER_CONTEXT:g}x", "kvleague": f"{best_ctx[0]:.1f}x ({best_ctx[1]})" if best_ctx else NOT_MEASURED,
                 "paper value inside 95% CI": "-", "problems": 0})
    rows += _systems_claims(latest_benchmark_runs(q.benchmark_rows(engine)))
    return pd.DataFrame(rows)


def _ratio_text(fig: dict[str, Any]) -> str:
    details = fig["details"] or {}
    if details.get("undetermined"):  # both methods fit the search cap: the ratio says nothing
        return f"undetermined: both reached the search cap (budget {fig['budget']})"
    return f"{'>= ' if details.get('at_least') else ''}{fig['value']:.2f}x at budget {fig['budget']}"


def _systems_claims(figures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The claims row for each systems-benchmark ratio (epikv over a reference), from the latest run:
    the largest ratio over the budgets measured."""
    claims = (("decoding speed epikv / full", "speed_ratio", "full", f"up to {PAPER_SPEEDUP:g}x"),
              ("decoding speed epikv / h2o", "speed_ratio", "h2o", "-"),
              ("feasible context epikv / h2o", "feasible_context_ratio", "h2o", f"{PAPER_CONTEXT:g}x"))
    rows = []
    for label, metric, reference, paper in claims:
        found = [f for f in figures if (f["metric"], f["method"], f["reference"]) == (metric, "epikv", reference)
                 and f["value"] is not None]
        best = max(found, key=lambda f: f["value"], default=None)
        rows.append({"claim": f"{label} (systems benchmark)", "paper": paper,
                     "kvleague": _ratio_text(best) if best else NOT_MEASURED, "paper value inside 95% CI": "-", "problems": 0})
    return rows


# ------------------------------------------------------------------------------------------------
# Systems benchmarks
# ------------------------------------------------------------------------------------------------

SYSTEMS_COLUMNS = ["benchmark", "method", "budget", "metric", "value", "unit", "reference", "note", "model", "hardware",
                   "measured at"]


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
    rows = [{"benchmark": r["benchmark"], "method": r["method"], "budget": r["budget"], "metric": r["metric"],
             "value": r["value"], "unit": r["unit"], "reference": r["reference"], "note": _note(r["details"]),
             "model": r["model"], "hardware": _hardware(r), "measured at": r["created_at"]}
            for r in latest_benchmark_runs(q.benchmark_rows(engine))]
    df = pd.DataFrame(rows, columns=SYSTEMS_COLUMNS)
    return df.astype({"budget": "Int64", "value": "float64"})


# ------------------------------------------------------------------------------------------------
# Cost
# ------------------------------------------------------------------------------------------------


def cost(engine, filters: q.Filters, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    """Per (method, budget): throughput, latency, memory, method overhead, accuracy with interval and
    whether the point is on the accuracy-vs-peak-KV-memory Pareto front."""
    dims = dims or q.dimensions(engine)
    methods = dims["methods"]
    rows = q.cost_rows(engine, filters)
    hist = q.problem_hist(engine, filters)
    acc: dict[tuple[int, int], list] = defaultdict(list)
    for h in hist:
        acc[(h["method_spec_id"], h["budget"])].append((h["k"], h["m"], h["problems"]))
    out = []
    for r in rows:
        a = _acc(acc.get((r["method_spec_id"], r["budget"]), []))
        model_s = float(r["model_seconds_sum"] or 0)
        out.append({
            "method": methods.get(r["method_spec_id"], {}).get("label", f"#{r['method_spec_id']}"),
            "budget": int(r["budget"]),
            "samples": int(r["samples"]),
            "accuracy": pct(a.mean),
            "acc_lo": pct(a.lo),
            "acc_hi": pct(a.hi),
            "tokens/s": _f(r["tokens_per_second"]),
            "ms/token": _f(r["seconds_per_token"], 1000),
            "ms/token p95": _f(r["seconds_per_token_p95"], 1000),
            "prefill s": _f(r["prefill_seconds"]),
            "peak KV MiB": _f(r["peak_kv_bytes"], 1 / 2**20),
            "peak KV MiB (max)": _f(r["peak_kv_bytes_max"], 1 / 2**20),
            "peak memory MiB (max)": _f(r["peak_memory_bytes_max"], 1 / 2**20),
            "peak cache entries": _f(r["peak_cache_entries"]),
            "method ms/sample": _f(r["method_seconds"], 1000),
            "method overhead %": 100 * float(r["method_seconds_sum"]) / model_s if r["method_seconds_sum"] is not None and model_s > 0 else math.nan,
        })
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


def samples(engine, filters: q.Filters, task_id: int, sample_id: str, budget: int | None, dims: dict[str, Any] | None = None) -> pd.DataFrame:
    dims = dims or q.dimensions(engine)
    methods = dims["methods"]
    rows = q.sample_rows(engine, filters, task_id, sample_id, budget)
    out = []
    for r in rows:
        out.append({
            "method": methods.get(r["method_spec_id"], {}).get("label", f"#{r['method_spec_id']}"),
            "budget": r["budget"], "sample_index": r["sample_index"], "seed": r["seed"], "status": r["status"],
            "correct": r["correct"], "extracted": r["extracted"], "generated_tokens": r["generated_tokens"],
            "prompt_tokens": r["prompt_tokens"], "evictions": r["evictions"], "evicted_tokens": r["evicted_tokens"],
            "peak_cache_entries": r["peak_cache_entries"], "stop_reason": r["stop_reason"], "flag": failure_flag(r),
            "completion": r["completion"], "error": r["error"], "sweep_id": r["sweep_id"], "id": r["id"],
        })
    return pd.DataFrame(out)
