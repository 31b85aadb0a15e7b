"""Every dashboard page under Streamlit's AppTest, on a database seeded through the db layer, with the
expected numbers computed here from the seeded rows (statsmodels / scipy / plain arithmetic), not by
analysis.stats or analysis.tables."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from kvleague.analysis import stats

pytest.importorskip("streamlit")
sm_proportion = pytest.importorskip("statsmodels.stats.proportion")
sm_tables = pytest.importorskip("statsmodels.stats.contingency_tables")
sm_multitest = pytest.importorskip("statsmodels.stats.multitest")
scipy_stats = pytest.importorskip("scipy.stats")

from streamlit.testing.v1 import AppTest  # noqa: E402

from kvleague.db.seed import Seeder  # noqa: E402
from kvleague.db.session import get_engine  # noqa: E402

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")
TIMEOUT = 60

TASKS = (("math500", "math", 40), ("gsm8k", "math", 30), ("humaneval", "code", 25))
BUDGETS = (64, 128, 4096)
METHODS = ("full", "epikv", "thinkv", "snapkv", "h2o")
#: correct iff the problem's difficulty is below the threshold (or inside a bonus window)
THRESHOLD = {
    "full": {64: 0.7, 128: 0.7, 4096: 0.7},
    "epikv": {64: 0.2, 128: 0.66, 4096: 0.7},
    "thinkv": {64: 0.5, 128: 0.5, 4096: 0.7},
    "snapkv": {64: 0.4, 128: 0.45, 4096: 0.7},
    "h2o": {64: 0.3, 128: 0.35, 4096: 0.7},
}
BONUS = {("epikv", 128): (0.9, 0.96)}  # epikv also solves some problems full cache misses (b > 0 for McNemar)
SAMPLED = {"task": "gsm8k", "budget": 128, "methods": ("full", "epikv", "thinkv"), "n": 3}
GIT = "c0ffee" + "0" * 34


def difficulty(i: int, n: int) -> float:
    return ((i * 7) % n + 0.5) / n  # a fixed permutation of evenly spaced difficulties (n not divisible by 7)


def is_correct(method: str, budget: int, d: float, shift: float = 0.0) -> bool:
    lo, hi = BONUS.get((method, budget), (2.0, 2.0))
    return d < THRESHOLD[method][budget] + shift or lo <= d < hi


def seed_db(path: Path) -> list[dict]:
    """Seed the database; return every row written, with task name, domain and method name added."""
    engine = get_engine(f"sqlite:///{path}")
    s = Seeder(engine)
    model = s.model("tiny-test")
    proto = s.protocol(sink=4, recent=8)
    greedy = s.generation(0.0)
    sampled = s.generation(0.7, 0.95)
    sweep = s.sweep("dash-test", {"name": "dash-test", "seeds": [0, 1]}, git_commit=GIT)
    meths = {m: s.method(m) for m in METHODS}
    out: list[dict] = []
    for _t_i, (task, domain, n) in enumerate(TASKS):
        task_id = s.task(task, domain)
        for m_i, method in enumerate(METHODS):
            for budget in BUDGETS:
                for i in range(n):
                    d = difficulty(i, n)
                    variants = [(greedy, 0, 0.0, 0)]
                    if task == SAMPLED["task"] and budget == SAMPLED["budget"] and method in SAMPLED["methods"]:
                        variants += [(sampled, j, (j - 1) * 0.1, 1) for j in range(SAMPLED["n"])]
                    for gen, j, shift, seed in variants:
                        correct = is_correct(method, budget, d, shift)
                        fired = method != "full" and budget < 4096 and i % 3 != 0
                        row = {
                            "sweep_id": sweep,
                            "model_id": model,
                            "method_spec_id": meths[method],
                            "task_id": task_id,
                            "protocol_id": proto,
                            "generation_id": gen,
                            "budget": budget,
                            "sample_id": f"{task}-{i:03d}",
                            "sample_index": j,
                            "seed": seed,
                        }
                        meta = {"task": task, "domain": domain, "method": method, "sampled": gen == sampled}
                        if method == "h2o" and budget == 128 and i == 0:
                            row.update(status="failed", error="RuntimeError: synthetic failure")
                            out.append({**row, **meta})
                            continue
                        completion = f"{method} reasoning for {task} {i}: the answer is {'A' if correct else 'B'}{i}"
                        if method == "h2o" and i == 1:
                            completion = ""
                        if method == "snapkv" and i == 1:
                            completion = "and then " * 40
                        row.update(
                            status="ok",
                            correct=correct,
                            score=float(correct),
                            extracted=f"{'A' if correct else 'B'}{i}",
                            completion=completion,
                            stop_reason="eos",
                            prompt_tokens=50 + i,
                            generated_tokens=100 + i,
                            prefill_seconds=0.01 * (m_i + 1),
                            decode_seconds_mean=0.001 * (m_i + 1) + budget * 1e-6,
                            decode_seconds_p50=0.001,
                            decode_seconds_p95=0.002,
                            tokens_per_second=1000 / (m_i + 1) - budget / 1000 + i % 2,
                            method_seconds=0.001 * m_i,
                            wall_seconds=0.5,
                            evictions=(i % 5 + 1) if fired else 0,
                            evicted_tokens=(i % 5 + 1) * 3 if fired else 0,
                            peak_cache_entries=min(budget, 150 + i) if method != "full" else 150 + i,
                            peak_kv_bytes=(min(budget, 150 + i) if method != "full" else 150 + i) * 1024,
                            peak_memory_bytes=2**30 + m_i,
                            peak_memory_source="cpu",
                            attn_implementation="sdpa",
                        )
                        out.append({**row, **meta})
    s.write([{k: v for k, v in r.items() if k not in ("task", "domain", "method", "sampled")} for r in out])
    engine.dispose()
    return out


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    path = tmp_path_factory.mktemp("dash") / "results.db"
    rows = seed_db(path)
    return f"sqlite:///{path}", rows


@pytest.fixture
def app(seeded, monkeypatch):
    url, _ = seeded
    monkeypatch.setenv("KVLEAGUE_DB", url)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, at.exception
    return at


# ------------------------------------------------------------------------------------------------
# Expected numbers, computed from the seeded rows
# ------------------------------------------------------------------------------------------------


def per_problem(rows, budget, decoding=("greedy", "sampled"), domains=None):
    """(method, domain) -> {problem cell: [k, m]} over ok and failed rows (a failed sample counts as wrong)."""
    out: dict[tuple[str, str], dict[tuple, list[int]]] = defaultdict(dict)
    for r in rows:
        if r["budget"] != budget:
            continue
        if ("sampled" if r["sampled"] else "greedy") not in decoding:
            continue
        if domains is not None and r["domain"] not in domains:
            continue
        key = (r["task"], r["sample_id"], r["generation_id"])
        km = out[(r["method"], r["domain"])].setdefault(key, [0, 0])
        km[0] += int(r["status"] == "ok" and r["correct"])
        km[1] += 1
    return out


def expected_accuracy(problems: dict, cells=None) -> float:
    """Mean over questions (task, sample id) of the mean share correct over the question's cells."""
    by_question = defaultdict(list)
    for key, (k, m) in problems.items():
        if cells is None or key in cells:
            by_question[key[:2]].append(k / m)
    return 100 * sum(sum(v) / len(v) for v in by_question.values()) / len(by_question)


def expected_mcnemar(a: dict, ref: dict):
    """Difference in points, McNemar's p and its name: below 25 discordant problems the exact test (or the
    score test where larger), else the score test at 0 (no continuity correction)."""
    keys = sorted(set(a) & set(ref))
    b = sum(1 for k in keys if a[k][0] and not ref[k][0])
    c = sum(1 for k in keys if ref[k][0] and not a[k][0])
    both = sum(1 for k in keys if a[k][0] and ref[k][0])
    neither = len(keys) - b - c - both
    table = np.array([[both, b], [c, neither]])
    p = sm_tables.mcnemar(table, exact=False, correction=False).pvalue if b + c else 1.0
    if b + c < 25:  # the label names the p printed
        exact = sm_tables.mcnemar(table, exact=True).pvalue
        return 100 * (b - c) / len(keys), max(p, exact), "exact McNemar" if exact >= p else stats.TANGO_LARGER
    return 100 * (b - c) / len(keys), p, "Tango score"


def wilson_text(problems: dict) -> str:
    k = sum(v[0] for v in problems.values())
    lo, hi = sm_proportion.proportion_confint(k, len(problems), alpha=0.05, method="wilson")
    return f"[{100 * lo:.1f}, {100 * hi:.1f}]"


def row_of(df, **match):
    sel = df
    for k, v in match.items():
        sel = sel[sel[k] == v]
    assert len(sel) == 1, (match, sel)
    return sel.iloc[0]


def _set_budget(at, budget):
    at.selectbox(key="lb_budget").set_value(budget).run()
    assert not at.exception, at.exception


# ------------------------------------------------------------------------------------------------
# Leaderboard
# ------------------------------------------------------------------------------------------------


def test_leaderboard_greedy_numbers(app, seeded):
    _, rows = seeded
    app.sidebar.multiselect(key="f_decoding").set_value(["greedy"]).run()
    assert not app.exception, app.exception
    assert app.selectbox(key="lb_budget").value == 128  # the middle of the budgets
    wide, detail = app.dataframe[0].value, app.dataframe[1].value
    exp = per_problem(rows, 128, ("greedy",))
    for method in METHODS:
        for domain in ("math", "code"):
            problems = exp[(method, domain)]
            acc = expected_accuracy(problems)
            w = row_of(wide, method=method)
            assert w[f"{domain} %"] == pytest.approx(acc, abs=1e-9)
            assert w[f"{domain} 95% CI"] == wilson_text(problems)
            d = row_of(detail, method=method, domain=domain)
            assert d["accuracy %"] == pytest.approx(acc, abs=1e-9)
            assert d["interval"] == "Wilson"
            assert d["problems"] == len(problems)
            if method == "full":
                assert d["test"] == "reference" and math.isnan(d["p"])
                continue
            diff, p, test = expected_mcnemar(problems, exp[("full", domain)])
            assert d["Δ vs full (pts)"] == pytest.approx(diff, abs=1e-9)
            assert d["p"] == pytest.approx(p, rel=1e-9)
            assert d["test"] == test
            assert d["vs best"] == "best" or "best" in d["vs best"] or d["vs best"] == "inconclusive"
            fired = [
                r
                for r in rows
                if r["method"] == method
                and r["domain"] == domain
                and r["budget"] == 128
                and r["status"] == "ok"
                and not r["sampled"]
            ]
            share = 100 * sum(1 for r in fired if r["evictions"] > 0) / len(fired)
            assert d["eviction fired %"] == pytest.approx(share, abs=1e-9)
        means = [expected_accuracy(exp[(method, d)]) for d in ("code", "math")]
        assert row_of(wide, method=method)["mean accuracy"] == pytest.approx(sum(means) / 2, abs=1e-9)
    # failed samples count as wrong and are shown: h2o failed problem 0 of each task at budget 128
    assert row_of(detail, method="h2o", domain="math")["failed"] == 2
    assert row_of(detail, method="h2o", domain="code")["failed"] == 1
    # rank follows the mean accuracy
    order = wide.sort_values("mean accuracy", ascending=False)["method"].tolist()
    assert wide.sort_values("rank")["method"].tolist() == order
    assert wide["rank"].tolist() == sorted(wide["rank"].tolist())
    # per task (expander)
    by_task = next(d.value for d in app.dataframe if "task" in d.value.columns)
    t = row_of(by_task, method="thinkv", task="humaneval")
    assert t["accuracy %"] == pytest.approx(expected_accuracy(exp[("thinkv", "code")]), abs=1e-9)
    # CSV export
    assert any(b.label == "Download CSV" for b in app.get("download_button")) or len(app.get("download_button")) >= 1


def test_leaderboard_other_budget_and_domain_filter(app, seeded):
    _, rows = seeded
    app.sidebar.multiselect(key="f_decoding").set_value(["greedy"]).run()
    _set_budget(app, 64)
    exp = per_problem(rows, 64, ("greedy",))
    detail = app.dataframe[1].value
    d = row_of(detail, method="epikv", domain="math")
    diff, p, _ = expected_mcnemar(exp[("epikv", "math")], exp[("full", "math")])
    assert d["Δ vs full (pts)"] == pytest.approx(diff, abs=1e-9) and diff < -30
    assert d["p"] == pytest.approx(p, rel=1e-9)
    app.sidebar.multiselect(key="f_domain").set_value(["code"]).run()
    assert not app.exception, app.exception
    detail = app.dataframe[1].value
    assert set(detail["domain"]) == {"code"}
    assert set(detail["method"]) == set(METHODS)


def design_effect_wilson(problems: dict, max_samples: int) -> tuple[float, float]:
    """Wilson on n / deff questions, deff = unbiased variance of the question shares over p(1 - p),
    clipped to [1 / max_samples, 1]: computed here with numpy and statsmodels."""
    shares = np.array([k / m for k, m in problems.values()])
    p = shares.mean()
    deff = min(1.0, max(1 / max_samples, shares.var(ddof=1) / (p * (1 - p))))
    n_eff = len(shares) / deff
    return sm_proportion.proportion_confint(p * n_eff, n_eff, alpha=0.05, method="wilson")


def test_leaderboard_sampled_uses_design_effect(app, seeded):
    _, rows = seeded
    app.sidebar.multiselect(key="f_decoding").set_value(["sampled"]).run()
    assert not app.exception, app.exception
    detail = app.dataframe[1].value
    exp = per_problem(rows, 128, ("sampled",))
    assert set(detail["method"]) == set(SAMPLED["methods"])
    for method in SAMPLED["methods"]:
        problems = exp[(method, "math")]
        d = row_of(detail, method=method, domain="math")
        assert d["accuracy %"] == pytest.approx(expected_accuracy(problems), abs=1e-9)
        assert d["interval"] == "Wilson, design effect"
        assert d["samples"] == SAMPLED["n"] * len(problems)
        lo, hi = design_effect_wilson(problems, SAMPLED["n"])
        assert d["95% CI"] == f"[{100 * lo:.1f}, {100 * hi:.1f}]"
        if method != "full":
            full = exp[("full", "math")]
            diffs = [problems[k][0] / problems[k][1] - full[k][0] / full[k][1] for k in problems]
            assert d["test"].startswith("Tango score")
            assert d["Δ vs full (pts)"] == pytest.approx(100 * sum(diffs) / len(diffs), abs=1e-9)


def test_leaderboard_all_decodings_pools_problems(app, seeded):
    _, rows = seeded
    detail = app.dataframe[1].value
    exp = per_problem(rows, 128)
    d = row_of(detail, method="epikv", domain="math")
    # one common set: only thinkv and full have sampled runs, so every method is scored on the greedy cells,
    # and the unit is the question (a gsm8k question's greedy and sampled cells are one question)
    greedy = {k for k in exp[("epikv", "math")] if k[2] == next(r["generation_id"] for r in rows if not r["sampled"])}
    assert d["accuracy %"] == pytest.approx(expected_accuracy(exp[("epikv", "math")], greedy), abs=1e-9)
    assert d["problems"] == 40 + 30  # math500 + gsm8k questions


# ------------------------------------------------------------------------------------------------
# Other pages
# ------------------------------------------------------------------------------------------------


def _goto(at, page):
    at.sidebar.radio(key="page").set_value(page).run()
    assert not at.exception, at.exception
    assert at.title[0].value == page


def test_budget_curves(app, seeded):
    _, rows = seeded
    app.sidebar.multiselect(key="f_decoding").set_value(["greedy"]).run()
    _goto(app, "Budget curves")
    curves, full = app.dataframe[0].value, app.dataframe[1].value
    assert len(app.get("vega_lite_chart")) == 2  # one chart per domain
    assert "full" not in set(curves["method"])
    for budget in BUDGETS:
        exp = per_problem(rows, budget, ("greedy",))
        for method in ("epikv", "h2o"):
            for domain in ("math", "code"):
                c = row_of(curves, method=method, domain=domain, budget=budget)
                assert c["accuracy"] == pytest.approx(expected_accuracy(exp[(method, domain)]), abs=1e-9)
    exp = per_problem(rows, 64, ("greedy",))  # full cache: same answers at every budget
    assert row_of(full, domain="code")["full cache %"] == pytest.approx(
        expected_accuracy(exp[("full", "code")]), abs=1e-9
    )


def test_scorecard(app, seeded):
    _, rows = seeded
    app.sidebar.multiselect(key="f_decoding").set_value(["greedy"]).run()
    _goto(app, "Replication scorecard")
    claims, card = app.dataframe[0].value, app.dataframe[1].value
    # paper claims: math500 at 4096 is measured, aime24 is not in this database
    math500_4096 = per_problem([r for r in rows if r["task"] == "math500"], 4096, ("greedy",))
    epikv_claim = row_of(claims, claim="EpiKV on math500 at budget 4096")
    assert epikv_claim["paper"] == "72%"
    assert epikv_claim["kvleague"].startswith(f"{expected_accuracy(math500_4096[('epikv', 'math')]):.1f}% ")
    aime = claims[claims["claim"].str.contains("aime24")]
    assert len(aime) == 3 and set(aime["kvleague"]) == {"not measured yet"}

    # speed: best ratio of mean tokens/s (EpiKV family / full cache) over budgets and domains
    def mean_of(col, method, budget, domain):
        return np.mean(
            [
                r[col]
                for r in rows
                if r["method"] == method
                and r["budget"] == budget
                and r["domain"] == domain
                and r["status"] == "ok"
                and not r["sampled"]
            ]
        )

    settings = [(b, d) for b in BUDGETS for d in ("math", "code")]
    speed = max(
        mean_of("tokens_per_second", "epikv", b, d) / mean_of("tokens_per_second", "full", b, d) for b, d in settings
    )
    assert row_of(claims, claim="decoding speed vs full cache (tokens/s), best setting")["kvleague"].startswith(
        f"{speed:.2f}x (epikv"
    )
    ctx = max(
        mean_of("peak_cache_entries", "full", b, d) / mean_of("peak_cache_entries", "epikv", b, d) for b, d in settings
    )
    ctx_row = row_of(claims, claim="feasible context in the same KV memory (full / method peak cache entries)")
    assert ctx_row["kvleague"].startswith(f"{ctx:.1f}x (epikv") and ctx > 2
    systems = claims[claims["claim"].str.endswith("(systems benchmark)")]
    assert len(systems) == 3 and set(systems["kvleague"]) == {"not measured yet"}  # none stored in this database
    # paper values are tested, not just compared with an interval: the score test of the measured share
    p0 = 0.72
    acc = expected_accuracy(math500_4096[("epikv", "math")]) / 100
    assert epikv_claim["p vs paper"] == pytest.approx(
        2 * scipy_stats.norm.sf(abs(acc - p0) / math.sqrt(p0 * (1 - p0) / 40)), rel=1e-9
    )
    tested = claims["p vs paper"].notna()
    holm = sm_multitest.multipletests(claims.loc[tested, "p vs paper"], method="holm")[1]
    assert claims.loc[tested, "p vs paper (Holm)"].tolist() == pytest.approx(list(holm), rel=1e-9)
    # one row per claim: better than each fixed paper baseline (h2o, thinkv), within 5 points of full cache
    assert set(card["claim"]) == {"better than h2o", "better than thinkv", "within 5 pts of full cache"}
    for budget in (64, 128):
        exp = per_problem(rows, budget, ("greedy",))
        for domain in ("math", "code"):
            for ref in ("h2o", "thinkv"):
                r = row_of(card, domain=domain, budget=budget, method="epikv", claim=f"better than {ref}")
                diff, p, _ = expected_mcnemar(exp[("epikv", domain)], exp[(ref, domain)])
                assert r["Δ"] == pytest.approx(diff, abs=1e-9) and r["p"] == pytest.approx(p, rel=1e-9)
            r = row_of(card, domain=domain, budget=budget, method="epikv", claim="within 5 pts of full cache")
            a, f = exp[("epikv", domain)], exp[("full", domain)]
            b = sum(1 for k in a if a[k][0] and not f[k][0])
            c = sum(1 for k in a if f[k][0] and not a[k][0])
            assert r["Δ"] == pytest.approx(100 * (b - c) / len(a), abs=1e-9)
            want = tango_pvalue_numeric(b, c, len(a), -0.05)
            _, p0, test = expected_mcnemar(a, f)
            if test == "exact McNemar" and (b - c) / len(a) <= -0.05:  # -5 pts lies between 0 and the estimate
                want = max(want, p0)
            assert r["p"] == pytest.approx(want, rel=1e-5)
            if budget == 64 and domain == "math":  # epikv collapses at 64: worse than thinkv and far below full
                assert (
                    row_of(card, domain=domain, budget=64, method="epikv", claim="better than thinkv")["verdict"]
                    == "does not replicate"
                )
                assert r["verdict"] == "does not replicate"
    # the declared rule (analysis/paper.yaml): Bonferroni over the pair's 4 domains, whatever else the table holds
    assert card["p (adj.)"].tolist() == pytest.approx([min(1.0, 4 * p) for p in card["p"]], rel=1e-9)
    r = row_of(card, domain="math", budget=128, method="epikv", claim="better than thinkv")
    assert r["p (adj.)"] < 0.05 and r["verdict"] == "replicates"  # 0.66 (+ bonus) vs 0.5 on 70 problems
    decided = card["verdict"].isin(["replicates", "does not replicate"])
    assert (card.loc[decided, "p (adj.)"] < 0.05).all() and (card.loc[~decided, "p (adj.)"] >= 0.05).all()


def tango_pvalue_numeric(b: int, c: int, n: int, delta: float) -> float:
    """Tango's score test computed from scratch: the restricted MLE of p21 (p12 = p21 + delta) by numeric
    maximisation of the multinomial likelihood, then z = (b - c - n delta) / sqrt(n (p12 + p21 - delta^2))."""
    from scipy.optimize import minimize_scalar

    lo, hi = max(0.0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12

    def nll(p21):
        p12 = p21 + delta
        return -(b * math.log(p12) + c * math.log(p21) + (n - b - c) * math.log(1 - p12 - p21))

    p21 = minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13}).x
    z = (b - c - n * delta) / math.sqrt(n * (2 * p21 + delta - delta**2))
    return 2 * scipy_stats.norm.sf(abs(z))


def test_cost(app, seeded):
    _, rows = seeded
    app.sidebar.multiselect(key="f_decoding").set_value(["greedy"]).run()
    _goto(app, "Cost")
    # the page's three tables (speed, memory, overhead), each beside method and budget: one row per point
    speed, memory, overhead = (app.dataframe[i].value for i in range(3))
    df = speed.merge(memory, on=["method", "budget"]).merge(overhead, on=["method", "budget"])
    for method in ("full", "snapkv"):
        for budget in BUDGETS:
            sel = [
                r
                for r in rows
                if r["method"] == method and r["budget"] == budget and r["status"] == "ok" and not r["sampled"]
            ]
            got = row_of(df, method=method, budget=budget)
            assert got["samples"] == len(sel)
            assert got["tokens/s"] == pytest.approx(np.mean([r["tokens_per_second"] for r in sel]), rel=1e-9)
            assert got["ms/token"] == pytest.approx(1000 * np.mean([r["decode_seconds_mean"] for r in sel]), rel=1e-9)
            assert got["peak KV MiB"] == pytest.approx(np.mean([r["peak_kv_bytes"] for r in sel]) / 2**20, rel=1e-9)
            assert got["accuracy"] == pytest.approx(100 * np.mean([r["correct"] for r in sel]), abs=1e-9)
    # the Pareto flag is no table column now (the chart draws the front): stats.pareto_front has its own test
    assert len(app.get("vega_lite_chart")) == 3
    assert len(app.dataframe) == 3 and "No systems benchmarks stored yet" in app.info[0].value


def test_samples(app, seeded):
    _, rows = seeded
    _goto(app, "Samples")
    task_ids = app.selectbox(key="sm_task").options
    assert len(task_ids) == len(TASKS)
    # pick humaneval, budget 128, problem 1 (h2o empty, snapkv loops)
    sb = app.selectbox(key="sm_task")
    sb.select_index(next(i for i, o in enumerate(sb.options) if o.startswith("humaneval"))).run()
    app.selectbox(key="sm_problem").set_value("humaneval-001").run()
    assert not app.exception, app.exception
    df = app.dataframe[0].value
    assert set(df["method"]) == set(METHODS)
    for method in METHODS:
        raw = next(
            r
            for r in rows
            if r["method"] == method
            and r["task"] == "humaneval"
            and r["sample_id"] == "humaneval-001"
            and r["budget"] == 128
        )
        got = row_of(df, method=method)
        assert bool(got["correct"]) == raw["correct"]
        assert got["extracted"] == raw["extracted"]
        assert got["evictions"] == raw["evictions"]
        assert got["generated_tokens"] == raw["generated_tokens"]
    assert row_of(df, method="h2o")["flag"] == "empty"
    assert row_of(df, method="snapkv")["flag"] == "loop"
    assert any("epikv" in m.value for m in app.markdown)
    # only problems where methods disagree
    app.checkbox(key="sm_disagree").check().run()
    assert not app.exception, app.exception
    problems = app.selectbox(key="sm_problem").options
    exp = per_problem([r for r in rows if r["task"] == "humaneval" and r["status"] == "ok"], 128)
    by_problem = defaultdict(set)
    for (_method, _), probs in exp.items():
        for key, (k, m) in probs.items():
            by_problem[key[1]].add(k == m)
    assert sorted(problems) == sorted(p for p, outcomes in by_problem.items() if len(outcomes) > 1)


def test_provenance(app, seeded):
    _, rows = seeded
    _goto(app, "Provenance")
    sweeps, envs = app.dataframe[0].value, app.dataframe[1].value
    s = row_of(sweeps, name="dash-test")
    assert s["git_commit"] == GIT
    assert s["rows"] == len(rows)
    assert s["ok_rows"] == sum(1 for r in rows if r["status"] == "ok")
    assert s["status"] == "finished"
    assert set(envs["hostname"]) == {"seed-host"}
    assert {"torch_version", "transformers_version", "gpu_name", "cuda_version"} <= set(envs.columns)
    seeds = app.dataframe[2].value
    assert sorted(seeds["seed"]) == [0, 1]
    protocols = app.dataframe[4].value
    assert protocols["sink"].tolist() == [4] and protocols["recent"].tolist() == [8]


def test_query_param_selects_page(seeded, monkeypatch):
    url, _ = seeded
    monkeypatch.setenv("KVLEAGUE_DB", url)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params["page"] = "cost"
    at.run()
    assert not at.exception
    assert at.title[0].value == "Cost"


# ------------------------------------------------------------------------------------------------
# Systems benchmarks (kvleague bench --store)
# ------------------------------------------------------------------------------------------------

BENCH_ENV = {
    "hostname": "bench-host",
    "platform": "Linux-bench",
    "gpu_name": "NVIDIA H200",
    "gpu_count": 1,
    "cuda_version": "12.8",
    "python_version": "3.11.9",
    "torch_version": "2.13.0",
    "transformers_version": "5.2.0",
    "kvleague_version": "0.1.0",
    "ray_version": "not installed",
    "git_commit": GIT,
    "git_dirty": False,
    "spec_hash": "b" * 64,
    "cpu_model": "bench CPU",
    "cpu_count": 16,
    "cpu_affinity": 16,
    "torch_threads": 1,
    "kvpress_version": "not installed",
    "load_average": [0.5],
}


def bench_report(benchmark, figures, created_at):
    """A report as ``kvleague bench`` writes it (validated by make_report), with figures named the way
    runner/bench/decode_speed.py and feasible_context.py name theirs."""
    from kvleague.runner.bench import harness as h

    report = h.make_report(
        benchmark,
        config={"model": "tiny", "model_label": "tiny-bench"},
        rows=[],
        figures=[h.figure(*f[:3], **f[3]) for f in figures],
        summary={},
        env=dict(BENCH_ENV),
    )
    report["created_at"] = created_at
    return report


def speed_report(epikv_over_full, epikv_over_h2o, created_at):
    figures = [("tokens_per_second", 123.5, "tokens/s", {"method": "full", "budget": 256, "clock": "cpu"})]
    for budget, ratio in epikv_over_full.items():
        figures.append(
            ("speed_ratio", ratio, "x", {"method": "epikv", "budget": budget, "reference": "full", "paper_claim": 2.8})
        )
    for budget, ratio in epikv_over_h2o.items():
        figures.append(
            ("speed_ratio", ratio, "x", {"method": "epikv", "budget": budget, "reference": "h2o", "clock": "cpu"})
        )
    return bench_report("decode_speed", figures, created_at)


def context_report(ratio, at_least, created_at):
    return bench_report(
        "feasible_context",
        [
            (
                "max_tokens",
                16384,
                "tokens",
                {"method": "epikv", "budget": 1024, "at_least": at_least, "bound": "token_cap"},
            ),
            ("max_tokens", 2048, "tokens", {"method": "h2o", "budget": 1024, "at_least": False, "bound": "memory"}),
            (
                "feasible_context_ratio",
                ratio,
                "x",
                {
                    "method": "epikv",
                    "budget": 1024,
                    "reference": "h2o",
                    "at_least": at_least,
                    "undetermined": False,
                    "paper_claim": 16.0,
                },
            ),
        ],
        created_at,
    )


def seeded_copy(seeded, tmp_path, monkeypatch) -> Path:
    """A copy of the seeded database (no benchmark rows) that the app will open."""
    import shutil

    path = tmp_path / "bench.db"
    shutil.copy(seeded[0].removeprefix("sqlite:///"), path)
    monkeypatch.setenv("KVLEAGUE_DB", f"sqlite:///{path}")
    return path


def cost_page() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params["page"] = "cost"
    at.run()
    assert not at.exception, at.exception
    return at


def test_cost_and_scorecard_show_stored_systems_benchmarks(seeded, tmp_path, monkeypatch):
    from kvleague.dashboard import ui
    from kvleague.runner.bench.storage import store_report

    url = f"sqlite:///{seeded_copy(seeded, tmp_path, monkeypatch)}"
    at = cost_page()
    assert "No systems benchmarks stored yet" in at.info[0].value
    old = speed_report({256: 9.5}, {256: 9.0}, "2025-01-01T00:00:00+00:00")  # superseded by the newer run
    new = speed_report({256: 1.25, 1024: 2.5, 4096: 1.75}, {256: 1.5, 1024: 1.125}, "2025-02-01T00:00:00+00:00")
    ctx = context_report(8.0, True, "2025-01-15T00:00:00+00:00")
    assert [store_report(r, url) for r in (old, new, ctx)] == [3, 6, 3]
    ui.fingerprint.clear()  # what the fingerprint's few-second TTL does on its own
    at.run()
    assert not at.exception, at.exception
    df = at.dataframe[3].value  # after the sweep cost's three tables
    assert len(df) == 9 and set(df["benchmark"]) == {"decode_speed", "feasible_context"}
    assert 9.5 not in set(df["value"]) and 9.0 not in set(df["value"])  # only the latest decode_speed run
    speed = df[(df["metric"] == "speed_ratio") & (df["reference"] == "full")].sort_values("budget")
    assert speed["budget"].tolist() == [256, 1024, 4096] and speed["value"].tolist() == [1.25, 2.5, 1.75]
    ratio = row_of(df, metric="feasible_context_ratio")
    assert (ratio["method"], ratio["reference"], ratio["value"], ratio["unit"]) == ("epikv", "h2o", 8.0, "x")
    assert ratio["note"].startswith("at least") and row_of(df, metric="max_tokens", method="h2o")["note"] == ""
    assert set(df["model"]) == {"tiny-bench"}
    assert set(df["hardware"]) == {"bench-host (Linux-bench; 1x NVIDIA H200, CUDA 12.8)"}
    assert str(row_of(df, metric="tokens_per_second")["measured at"]).startswith("2025-02-01")
    assert any(b.key == "systems_csv" for b in at.get("download_button"))

    _goto(at, "Replication scorecard")
    claims = at.dataframe[0].value
    # every speed figure names its set-up (model, backend, batch, machine, when, quick or not)
    setup = "[model tiny-bench, backend -, batch -, bench-host (Linux-bench; 1x NVIDIA H200, CUDA 12.8)"
    paper, ours = row_of(claims, claim="decoding speed epikv / full (systems benchmark)")[["paper", "kvleague"]]
    assert paper == "up to 2.8x" and ours.startswith(f"2.50x at budget 1024 {setup}"), ours
    assert row_of(claims, claim="decoding speed epikv / h2o (systems benchmark)")["kvleague"].startswith(
        f"1.50x at budget 256 {setup}"
    )
    paper, ours = row_of(claims, claim="feasible context epikv / h2o (systems benchmark)")[["paper", "kvleague"]]
    assert paper == "16x" and ours.startswith(f">= 8.00x at budget 1024 {setup}"), ours


def test_cost_renders_on_a_schema_without_the_benchmark_table(seeded, tmp_path, monkeypatch):
    import sqlite3

    conn = sqlite3.connect(seeded_copy(seeded, tmp_path, monkeypatch))
    conn.execute("DROP TABLE benchmark_results")  # a database from before migration 0002
    conn.close()
    at = cost_page()
    assert len(at.dataframe) == 3 and "No systems benchmarks stored yet" in at.info[0].value
    _goto(at, "Replication scorecard")
    systems = at.dataframe[0].value
    assert set(systems[systems["claim"].str.endswith("(systems benchmark)")]["kvleague"]) == {"not measured yet"}


# ------------------------------------------------------------------------------------------------
# Database states
# ------------------------------------------------------------------------------------------------


def test_missing_database_is_a_message(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEAGUE_DB", f"sqlite:///{tmp_path}/nothing.db")
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert not at.exception
    assert "no SQLite file" in at.error[0].value
    assert not (tmp_path / "nothing.db").exists()  # read-only: never creates the file


def test_empty_database_is_a_message(tmp_path, monkeypatch):
    from kvleague.db.session import upgrade

    url = f"sqlite:///{tmp_path}/empty.db"
    engine = get_engine(url)
    upgrade(engine)
    engine.dispose()
    monkeypatch.setenv("KVLEAGUE_DB", url)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert not at.exception
    assert "No results" in at.info[0].value


def test_new_results_invalidate_the_cache(tmp_path, monkeypatch):
    from kvleague.dashboard import ui

    url = f"sqlite:///{tmp_path}/grow.db"
    engine = get_engine(url)
    s = Seeder(engine)
    ids = dict(
        model_id=s.model("m"),
        task_id=s.task("math500", "math"),
        protocol_id=s.protocol(),
        generation_id=s.generation(),
        sweep_id=s.sweep("grow"),
        budget=64,
        sample_index=0,
        seed=0,
    )
    full, h2o = s.method("full"), s.method("h2o")
    s.write(
        [
            {**ids, "method_spec_id": m, "sample_id": f"p{i}", "status": "ok", "correct": i < 2, "evictions": 0}
            for m in (full, h2o)
            for i in range(4)
        ]
    )
    monkeypatch.setenv("KVLEAGUE_DB", url)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert row_of(at.dataframe[1].value, method="h2o")["accuracy %"] == pytest.approx(50.0)
    s.write(
        [
            {**ids, "method_spec_id": m, "sample_id": f"p{i}", "status": "ok", "correct": True, "evictions": 1}
            for m in (full, h2o)
            for i in range(4, 8)
        ]
    )
    ui.fingerprint.clear()  # what the fingerprint's few-second TTL does on its own
    at.run()
    assert not at.exception
    assert row_of(at.dataframe[1].value, method="h2o")["accuracy %"] == pytest.approx(75.0)
    engine.dispose()
