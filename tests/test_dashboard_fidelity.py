"""Fidelity on the dashboard, under Streamlit's AppTest, on a database seeded with generation and
fidelity rows: the leaderboard's fidelity table, the paired differences, the fidelity budget curves and
the scorecard's fidelity claims, each checked against numbers computed here from the seeded rows (naive
loops, a naive percentile bootstrap, scipy's Wilcoxon, statsmodels' Holm)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("streamlit")
sm_multitest = pytest.importorskip("statsmodels.stats.multitest")
scipy_stats = pytest.importorskip("scipy.stats")

from streamlit.testing.v1 import AppTest  # noqa: E402

from kvleague.db.seed import Seeder  # noqa: E402
from kvleague.db.session import get_engine  # noqa: E402

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")
TIMEOUT = 60

TASKS = (("math500", "math", 30), ("humaneval", "code", 24))
BUDGETS = (64, 128)
METHODS = ("full", "epikv", "h2o", "streaming_llm")
BASE_KL = {"full": 0.0, "epikv": 0.02, "h2o": 0.05, "streaming_llm": 0.09}
#: full cache right on this share of the questions: math below the scorecard's floor, code above it
FULL_ACCURACY = {"math": 0.1, "code": 0.6}
MISSING = ("h2o", 128, "math500-000")  # one fidelity cell h2o never produced: every math table at 128 drops that sample


def kl_of(method: str, budget: int, i: int, seed: int) -> float:
    if method == "full":
        return 1e-9 * (i % 3)  # float rounding, as a real full-cache run gives
    return BASE_KL[method] * (128 / budget) * (1 + ((i * 7 + seed * 3) % 11) / 5)


def top1_of(method: str, budget: int, i: int, seed: int) -> float:
    """A share of the 24 scored tokens, as the engine stores it."""
    return 1.0 if method == "full" else round(24 * (1 - min(0.9, 3 * kl_of(method, budget, i, seed)))) / 24


def seed_db(path: Path) -> list[dict]:
    """Generation rows (one greedy sample per question) and fidelity rows (two seeds per sample, so a
    sample's cells are averaged); returns the fidelity rows written, with names added."""
    engine = get_engine(f"sqlite:///{path}")
    s = Seeder(engine)
    model, proto = s.model("tiny-test"), s.protocol(sink=4, recent=8)
    greedy, teacher_forced = s.generation(0.0), s.generation(0.0, max_new_tokens=24)
    sweep = s.sweep("fidelity-test")
    meths = {m: s.method(m) for m in METHODS}
    generation, fidelity = [], []
    for task, domain, n in TASKS:
        task_id = s.task(task, domain)
        for method in METHODS:
            for budget in BUDGETS:
                for i in range(n):
                    cell = {
                        "sweep_id": sweep,
                        "model_id": model,
                        "method_spec_id": meths[method],
                        "task_id": task_id,
                        "protocol_id": proto,
                        "budget": budget,
                        "sample_id": f"{task}-{i:03d}",
                        "sample_index": 0,
                    }
                    correct = i < FULL_ACCURACY[domain] * n and (method == "full" or i % 2 == 0)
                    generation.append(
                        {
                            **cell,
                            "generation_id": greedy,
                            "seed": 0,
                            "correct": correct,
                            "score": float(correct),
                            "evictions": 0 if method == "full" else 3,
                        }
                    )
                    if (method, budget, cell["sample_id"]) == MISSING:
                        continue
                    for seed in (0, 1):
                        fidelity.append(
                            {
                                **cell,
                                "generation_id": teacher_forced,
                                "seed": seed,
                                "measure": "fidelity",
                                "kl_mean": kl_of(method, budget, i, seed),
                                "top1_agreement": top1_of(method, budget, i, seed),
                                "delta_nll_mean": kl_of(method, budget, i, seed) / 2,
                                "scored_tokens": 24,
                                "task": task,
                                "domain": domain,
                                "method": method,
                            }
                        )
    failed = {
        **fidelity[-1],
        "seed": 2,
        "status": "failed",
        "error": "RuntimeError: synthetic",
        "kl_mean": None,
        "top1_agreement": None,
    }  # a failed fidelity cell is no sample
    s.write(
        [
            *generation,
            *({k: v for k, v in r.items() if k not in ("task", "domain", "method")} for r in [*fidelity, failed]),
        ]
    )
    engine.dispose()
    return fidelity


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    path = tmp_path_factory.mktemp("dash-fidelity") / "results.db"
    return f"sqlite:///{path}", seed_db(path)


def _app(seeded, monkeypatch, page: str | None = None) -> AppTest:
    monkeypatch.setenv("KVLEAGUE_DB", seeded[0])
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    if page:
        at.query_params["page"] = page
    at.run()
    assert not at.exception, at.exception
    return at


def _frame(at, *columns):
    found = [d.value for d in at.dataframe if all(c in d.value.columns for c in columns)]
    assert found, [list(d.value.columns) for d in at.dataframe]
    return found[0]


def row_of(df, **match):
    sel = df
    for k, v in match.items():
        sel = sel[sel[k] == v]
    assert len(sel) == 1, (match, sel)
    return sel.iloc[0]


# ------------------------------------------------------------------------------------------------
# Expected numbers, computed from the seeded rows
# ------------------------------------------------------------------------------------------------


def per_sample(rows, budget, domain):
    """method -> sample id -> (mean KL, mean top-1) over the sample's cells (its seeds)."""
    acc = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["budget"] == budget and r["domain"] == domain:
            acc[r["method"]][r["sample_id"]].append((r["kl_mean"], r["top1_agreement"]))
    return {
        m: {sid: tuple(sum(v[k] for v in vals) / len(vals) for k in (0, 1)) for sid, vals in by.items()}
        for m, by in acc.items()
    }


def common(samples, methods):
    keys = set.intersection(*(set(samples[m]) for m in methods))
    return sorted(keys)


def naive_bootstrap(values, resamples=20000, seed=12345):
    """Percentile bootstrap of the mean by a plain loop over resamples (its own generator)."""
    rng = np.random.default_rng(seed)
    v = np.asarray(values)
    means = [v[rng.integers(0, len(v), len(v))].mean() for _ in range(resamples)]
    return np.percentile(means, 2.5), np.percentile(means, 97.5)


def wilson_design(shares, max_tokens):
    """The Wilson interval (%) of the mean per-sample share with the design effect of tokens within samples:
    observed variance of the mean over the binomial one, clipped to [1 / max_tokens, 1] (docs/statistics.md)."""
    from statsmodels.stats.proportion import proportion_confint

    v = np.asarray(shares, dtype=float)
    n, p = len(v), float(v.mean())
    binomial = p * (1 - p) / n
    deff = min(1.0, max(1 / max_tokens, v.var(ddof=1) / n / binomial)) if binomial > 0 else 1.0
    lo, hi = proportion_confint(p * n / deff, n / deff, method="wilson")
    return 100 * lo, 100 * hi


def assert_interval_close(text, values, digits, scale=1.0):
    lo, hi = (float(x) for x in text.strip("[]").split(","))
    want_lo, want_hi = naive_bootstrap(values)
    width = want_hi - want_lo
    assert width > 0
    # two Monte Carlo estimates of the same percentile interval: equal up to resampling noise and rounding
    assert abs(lo - want_lo * scale) <= 0.08 * width * scale + 10**-digits
    assert abs(hi - want_hi * scale) <= 0.08 * width * scale + 10**-digits


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


def test_leaderboard_shows_fidelity_beside_accuracy(seeded, monkeypatch):
    _, rows = seeded
    at = _app(seeded, monkeypatch)
    at.selectbox(key="lb_budget").set_value(128).run()
    assert not at.exception, at.exception
    detail = _frame(at, "accuracy %", "domain")
    # the fidelity rows are not generations: the accuracy tables count one greedy sample per question
    assert row_of(detail, method="full", domain="math")["samples"] == 30
    assert row_of(detail, method="full", domain="math")["accuracy %"] == pytest.approx(100 * 3 / 30)
    board = _frame(at, "KL 95% CI", "top-1 95% CI", "domain")
    for domain, n in (("math", 29), ("code", 24)):  # math at 128: h2o lacks one sample, so every method drops it
        samples = per_sample(rows, 128, domain)
        keys = common(samples, METHODS)
        assert len(keys) == n
        for method in METHODS:
            kl = [samples[method][k][0] for k in keys]
            top1 = [100 * samples[method][k][1] for k in keys]
            r = row_of(board, method=method, domain=domain)
            assert r["samples"] == n and r["tokens"] == 2 * 24 * n
            assert r["KL"] == pytest.approx(sum(kl) / n, rel=1e-12, abs=1e-15)
            assert r["top-1 %"] == pytest.approx(sum(top1) / n, rel=1e-12)
            # top-1: Wilson over tokens with their design effect (2 seeds x 24 tokens a sample), never a point
            lo, hi = wilson_design([t / 100 for t in top1], 48)
            assert r["top-1 95% CI"] == f"[{lo:.1f}, {hi:.1f}]" and lo < hi
            if method == "full":
                assert r["KL"] <= 1e-6 and r["top-1 %"] == 100.0
            else:
                assert_interval_close(r["KL 95% CI"], kl, 4)
    # lowest KL first within a domain
    math_rows = board[board["domain"] == "math"]
    assert math_rows["method"].tolist() == ["full", "epikv", "h2o", "streaming_llm"]

    pairs = _frame(at, "p (Wilcoxon)", "Δ KL (A−B)")
    assert len(pairs) == 2 * 6  # two domains x every pair of four methods
    want_p = []
    for _, r in pairs.iterrows():
        samples = per_sample(rows, 128, r["domain"])
        keys = common(samples, [r["A"], r["B"]])  # each pair on the samples the two have
        d = [samples[r["A"]][k][0] - samples[r["B"]][k][0] for k in keys]
        assert r["samples"] == len(keys) and r["tied"] == 0
        assert r["Δ KL (A−B)"] == pytest.approx(sum(d) / len(d), rel=1e-12, abs=1e-15)
        assert r["p (Wilcoxon)"] == pytest.approx(scipy_stats.wilcoxon(d).pvalue, rel=1e-12)
        walsh = [(x + y) / 2 for i, x in enumerate(d) for y in d[i:]]
        assert r["HL shift"] == pytest.approx(float(np.median(walsh)), rel=1e-12, abs=1e-15)
        want_p.append(scipy_stats.wilcoxon(d).pvalue)
    assert pairs["p (adj.)"].tolist() == pytest.approx([min(1.0, 4 * p) for p in want_p], rel=1e-12)
    a = row_of(pairs, domain="code", A="epikv", B="streaming_llm")
    assert a["Δ KL (A−B)"] < 0 and a["p (adj.)"] < 0.05 and a["verdict"] == "A lower"


def test_budget_curves_plot_fidelity(seeded, monkeypatch):
    _, rows = seeded
    at = _app(seeded, monkeypatch, "budget-curves")
    at.radio(key="bc_measure").set_value("KL to full cache").run()
    assert not at.exception, at.exception
    assert len(at.get("vega_lite_chart")) == 2  # one chart per domain
    curves = _frame(at, "KL lo", "budget")
    assert "full" not in set(curves["method"])
    for budget in BUDGETS:
        for domain in ("math", "code"):
            samples = per_sample(rows, budget, domain)
            keys = common(samples, [m for m in METHODS if m != "full"])
            for method in ("epikv", "streaming_llm"):
                c = row_of(curves, method=method, domain=domain, budget=budget)
                assert c["KL"] == pytest.approx(sum(samples[method][k][0] for k in keys) / len(keys), rel=1e-12)
                assert c["KL lo"] <= c["KL"] <= c["KL hi"]
    # streaming_llm loses more at the smaller budget
    sl = curves[curves["method"] == "streaming_llm"].set_index(["domain", "budget"])["KL"]
    assert sl[("math", 64)] > sl[("math", 128)]
    at.radio(key="bc_measure").set_value("top-1 agreement").run()
    assert not at.exception, at.exception
    assert len(at.get("vega_lite_chart")) == 2


def test_scorecard_uses_fidelity_where_full_accuracy_is_below_the_floor(seeded, monkeypatch):
    _, rows = seeded
    at = _app(seeded, monkeypatch, "replication-scorecard")
    card = _frame(at, "why fidelity", "Δ KL")
    # math: full cache right on 10% (< 20%): judged by fidelity; code: 60%, left to the accuracy scorecard
    assert set(card["domain"]) == {"math"} and set(card["budget"]) == set(BUDGETS)
    assert set(card["why fidelity"]) == {"full-cache accuracy 10.0% < 20%"}
    want_p = []
    for _, r in card.iterrows():
        assert (r["method"], r["reference"], r["claim"]) == ("epikv", "h2o", "closer to full cache than h2o")
        samples = per_sample(rows, r["budget"], "math")
        keys = common(samples, ["epikv", "h2o"])
        d = [samples["epikv"][k][0] - samples["h2o"][k][0] for k in keys]
        assert r["samples"] == len(keys) and r["Δ KL"] == pytest.approx(sum(d) / len(d), rel=1e-12)
        assert r["p"] == pytest.approx(scipy_stats.wilcoxon(d).pvalue, rel=1e-12)
        want_p.append(r["p"])
    assert card["p (adj.)"].tolist() == pytest.approx([min(1.0, 4 * p) for p in want_p], rel=1e-12)
    assert set(card["verdict"]) == {"replicates"}  # epikv's KL is lower than h2o's on every sample


def test_a_fidelity_only_database_shows_its_tables(tmp_path, monkeypatch):
    """A sweep with only ``measure: fidelity`` tasks: the leaderboard has no accuracy, and shows fidelity."""
    engine = get_engine(f"sqlite:///{tmp_path / 'only.db'}")
    s = Seeder(engine)
    task, gen = s.task("niah", "longqa"), s.generation(0.0, max_new_tokens=24)
    cells = dict(
        sweep_id=s.sweep("only"),
        model_id=s.model("m"),
        task_id=task,
        protocol_id=s.protocol(),
        generation_id=gen,
        budget=64,
        sample_index=0,
        seed=0,
        measure="fidelity",
        scored_tokens=24,
    )
    rows = [
        {
            **cells,
            "method_spec_id": s.method(m),
            "sample_id": f"n{i}",
            "kl_mean": BASE_KL[m] * (1 + i / 10),
            "top1_agreement": 1 - BASE_KL[m],
            "delta_nll_mean": 0.0,
        }
        for m in METHODS
        for i in range(12)
    ]
    # full cache measured once, at another budget, as a sweep does; two samples of it at 64 too: fewer, so not used
    rows = [{**r, "budget": 32} if r["method_spec_id"] == s.method("full") else r for r in rows]
    rows += [
        {**r, "budget": 64} for r in rows if r["method_spec_id"] == s.method("full") and r["sample_id"] in ("n0", "n1")
    ]
    s.write(rows)
    engine.dispose()
    monkeypatch.setenv("KVLEAGUE_DB", f"sqlite:///{tmp_path / 'only.db'}")
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, at.exception
    at.selectbox(key="lb_budget").set_value(64).run()
    assert not at.exception, at.exception
    board = _frame(at, "KL 95% CI", "domain")
    assert row_of(board, method="h2o", domain="longqa")["KL"] == pytest.approx(0.05 * (1 + 5.5 / 10), rel=1e-12)
    assert row_of(board, method="full", domain="longqa")["samples"] == 12  # its 12 samples at budget 32 stand in
    assert any("Full cache (the same at every budget) is its measurement at budget 32" in c.value for c in at.caption)
    assert not any("accuracy %" in d.value.columns for d in at.dataframe)


def test_the_markdown_table_holds_the_boards_figures(seeded):
    """``python -m analysis.fidelity_tables``: one line per (domain, method, budget), numbers from the seeded rows."""
    from kvleague.analysis import fidelity_tables as fidelity
    from kvleague.analysis import queries

    url, rows = seeded
    text = fidelity.markdown(queries.open_readonly(url))
    lines = text.splitlines()[2:]
    assert len(lines) == 2 * len(METHODS) * len(BUDGETS)  # domains x methods x budgets
    samples = per_sample(rows, 64, "code")
    kl = sum(v[0] for v in samples["h2o"].values()) / 24
    top1 = 100 * sum(v[1] for v in samples["h2o"].values()) / 24
    assert any(ln.startswith(f"| code | h2o | 64 | 24 | {kl:.4f} [") and f"| {top1:.1f} [" in ln for ln in lines), text
