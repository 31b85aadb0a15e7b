"""What a researcher sees first, on every page of the app (Streamlit's AppTest, in process), on two
databases: the committed replication export (three protocols, accuracy and fidelity) and a seeded
realistic sweep. Every page opens on data, every chart's spec passes :mod:`dashboard.chart_checks`,
and the defaults and lines are checked against SQL written here."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import altair as alt
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvleague.dashboard import chart_checks
from kvleague.dashboard.ui import PAGES
from kvleague.db.seed import TASKS, RealisticSpec, Seeder, realistic_rows
from kvleague.db.session import get_engine
from tests.conftest import REPO

APP = str(REPO / "dashboard" / "app.py")
TIMEOUT = 300
#: the seeded sweep with fewer problems per task (a quick database)
PROBLEMS = {"math500": 60, "aime24": 30, "humaneval": 40, "kv_agent": 40, "niah": 40}


@pytest.fixture(scope="module")
def replication_db(tmp_path_factory) -> Path:
    from kvleague.db.transfer import import_

    path = tmp_path_factory.mktemp("replication") / "replication.db"
    engine = get_engine(f"sqlite:///{path}")
    import_(engine, REPO / "results" / "replication.jsonl.gz")
    engine.dispose()
    return path


@pytest.fixture(scope="module")
def seeded_db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("seeded") / "seeded.db"
    engine = get_engine(f"sqlite:///{path}")
    s = Seeder(engine)
    tasks = tuple((name, domain, PROBLEMS[name], acc, typical) for name, domain, _, acc, typical in TASKS)
    s.write([dict(r) for r in realistic_rows(s, RealisticSpec(tasks=tasks, sweep="views", fail_rate=0.0))])
    engine.dispose()
    return path


def sql(path: Path, query: str, *args) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(query, args).fetchall()


def open_page(path: Path, page: str, monkeypatch) -> AppTest:
    monkeypatch.setenv("KVLEAGUE_DB", f"sqlite:///{path}")
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    at.sidebar.radio(key="page").set_value(page).run()
    assert not at.exception, at.exception
    return at


def charts(at: AppTest) -> list[tuple[dict, dict[str, pd.DataFrame]]]:
    return [
        (json.loads(c.proto.spec), {d.name: chart_checks.arrow_frame(d.data.data) for d in c.proto.datasets})
        for c in at.get("vega_lite_chart")
    ]


def assert_opens_on_data(at: AppTest, where: str) -> None:
    shown = [c for c in charts(at)]
    tables = [len(d.value) for d in at.dataframe]
    assert shown or any(tables), f"{where}: neither a chart nor a table with rows"
    empty = [i.value for i in at.info if "match" in i.value or "No results" in i.value]
    assert not empty, f"{where}: {empty}"
    for spec, data in shown:
        assert chart_checks.problems(spec, data) == [], where


# ------------------------------------------------------------------------------------------------
# The checks themselves: each fault the issue found is caught
# ------------------------------------------------------------------------------------------------

METHODS15 = [f"method{i:02d}" for i in range(15)]


def _spec(chart: alt.TopLevelMixin) -> tuple[dict, dict[str, pd.DataFrame]]:
    spec = chart.to_dict()
    datasets = {name: pd.DataFrame(rows) for name, rows in spec.pop("datasets", {}).items()}
    return spec, datasets


def _curves(protocol_of_budget) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "method": m,
                "budget": b,
                "accuracy": 50.0,
                "model": "m",
                "protocol": protocol_of_budget(b),
                "generation": "g",
            }
            for m in METHODS15[:3]
            for b in (48, 96, 128, 192, 256)
        ]
    )


def test_chart_checks_catch_a_line_across_protocols():
    joined = _curves(lambda b: "#2" if b in (128, 256) else "#1")
    by_method = alt.Chart(joined).mark_line().encode(x="budget:Q", y="accuracy:Q", color="method:N")
    assert "a line across budgets joins 2 different values of protocol" in chart_checks.problems(*_spec(by_method))
    by_slice = by_method.encode(detail=["model:N", "protocol:N", "generation:N"])
    assert chart_checks.problems(*_spec(by_slice)) == []
    unlabelled = (
        alt.Chart(joined.drop(columns=["protocol"])).mark_line().encode(x="budget:Q", y="accuracy:Q", color="method:N")
    )
    assert chart_checks.problems(*_spec(unlabelled)) == ["a line across budgets whose points do not say their protocol"]


def test_chart_checks_catch_cut_and_missing_legends():
    data = pd.DataFrame({"method": METHODS15, "x": range(15), "y": range(15)})
    side = alt.Chart(data).mark_point().encode(x="x:Q", y="y:Q", color="method:N").properties(height=200)
    assert chart_checks.problems(*_spec(side)) == [
        "the legend of method (15 rows at the side) is taller than the chart (200px): it is cut off"
    ]
    none = alt.Chart(data).mark_point().encode(x="x:Q", y="y:Q", color=alt.Color("method:N", legend=None))
    assert chart_checks.problems(*_spec(none)) == ["15 series of method with neither a legend nor direct labels"]
    # one layer switching the legend off switches it off for all (what hid the Signals page's legend)
    lines = alt.Chart(data).mark_line().encode(x="x:Q", y="y:Q", stroke="method:N")
    mixed = alt.layer(
        lines, alt.Chart(data).mark_area().encode(x="x:Q", y="y:Q", fill=alt.Fill("method:N", legend=None))
    )
    assert chart_checks.problems(*_spec(mixed)) == ["15 series of method with neither a legend nor direct labels"]
    limited = (
        alt.Chart(data)
        .mark_point()
        .encode(
            x="x:Q", y="y:Q", color=alt.Color("method:N", legend=alt.Legend(symbolLimit=8, orient="bottom", columns=5))
        )
        .properties(height=400)
    )
    assert chart_checks.problems(*_spec(limited)) == ["the legend of method lists 8 of its 15 values"]
    narrow_domain = (
        alt.Chart(data)
        .mark_point()
        .encode(
            x="x:Q",
            y="y:Q",
            color=alt.Color(
                "method:N", scale=alt.Scale(domain=METHODS15[:10]), legend=alt.Legend(orient="bottom", columns=5)
            ),
        )
        .properties(height=400)
    )
    assert chart_checks.problems(*_spec(narrow_domain))[0].startswith("the colour scale of method leaves out")
    assert chart_checks.problems(*_spec(alt.Chart(data.iloc[:0]).mark_point().encode(x="x:Q"))) == [
        "the chart has no data"
    ]


# ------------------------------------------------------------------------------------------------
# Every page of both databases
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("db", ["replication_db", "seeded_db"])
def test_every_page_opens_on_data_with_sound_charts(db, page, request, monkeypatch):
    path = request.getfixturevalue(db)
    if page == "Signals" and db == "seeded_db":
        pytest.skip("the seeded sweep has no signal studies (the page says so)")
    at = open_page(path, page, monkeypatch)
    assert_opens_on_data(at, f"{db} {page}")
    if page == "Budget curves" and db == "replication_db":
        for measure in ("KL to full cache", "top-1 agreement"):
            at.radio(key="bc_measure").set_value(measure).run()
            assert not at.exception, at.exception
            assert_opens_on_data(at, f"{db} {page} {measure}")


def _protocol_id(label: str) -> int:
    return int(label.split(":", 1)[0].lstrip("#"))


def test_budget_curves_open_on_the_largest_slice_and_never_join_protocols(replication_db, monkeypatch):
    at = open_page(replication_db, "Budget curves", monkeypatch)
    at.radio(key="bc_measure").set_value("KL to full cache").run()
    counts = sql(
        replication_db,
        "SELECT model_id, protocol_id, generation_id, COUNT(*) FROM sample_results "
        "WHERE measure = 'fidelity' GROUP BY 1, 2, 3 ORDER BY 4 DESC",
    )
    assert len(counts) == 6  # protocols #1-#6 (each its own fidelity settings)
    slice_box = at.selectbox(key="bc_fidelity_slice")
    assert tuple(slice_box.value) == counts[0][:3]
    for i in range(len(slice_box.options)):
        at.selectbox(key="bc_fidelity_slice").select_index(i).run()
        assert not at.exception, at.exception
        assert tuple(at.selectbox(key="bc_fidelity_slice").value) == counts[i][:3]
        for spec, data in charts(at):
            assert chart_checks.problems(spec, data) == []
            line = next(d for d in data.values() if "method" in d.columns)
            for protocol, rows in line.groupby("protocol"):
                budgets = {
                    b
                    for (b,) in sql(
                        replication_db,
                        "SELECT DISTINCT budget FROM sample_results WHERE measure = 'fidelity' AND protocol_id = ?",
                        _protocol_id(protocol),
                    )
                }
                assert set(rows["budget"]) <= budgets, (protocol, sorted(rows["budget"].unique()), budgets)


def test_leaderboard_opens_on_the_budget_with_the_most_results(replication_db, monkeypatch):
    at = open_page(replication_db, "Leaderboard", monkeypatch)
    counts = sql(
        replication_db,
        "SELECT budget, COUNT(*) FROM sample_results WHERE measure = 'generation' GROUP BY budget ORDER BY 2 DESC, 1",
    )
    assert at.selectbox(key="lb_budget").value == counts[0][0]
    methods = sql(
        replication_db,
        "SELECT COUNT(DISTINCT method_spec_id) FROM sample_results WHERE measure = 'generation' AND budget = ?",
        counts[0][0],
    )[0][0]
    assert len(at.dataframe[0].value) == methods > 1


def test_the_budget_filter_says_which_budgets_are_room_on_top_of_the_prompt(replication_db, monkeypatch):
    """The export's 64 is only ever ``prompt+64`` (the paper-regime runs); the others are absolute."""
    at = open_page(replication_db, "Leaderboard", monkeypatch)
    kinds = sql(
        replication_db,
        "SELECT DISTINCT r.budget, p.budget_base FROM sample_results r "
        "JOIN protocols p ON p.id = r.protocol_id ORDER BY 1",
    )
    expected = {}
    for budget, base in kinds:
        expected.setdefault(budget, []).append(f"prompt+{budget:,}" if base == "prompt" else f"{budget:,}")
    assert ["prompt+64"] in expected.values()
    shown = at.sidebar.multiselect(key="f_budget").options  # as the format function writes them
    assert sorted(shown) == sorted(" / ".join(v) for v in expected.values()), shown


def test_samples_open_on_problems_and_task_variants_are_told_apart(replication_db, monkeypatch):
    at = open_page(replication_db, "Samples", monkeypatch)
    box = at.selectbox(key="sm_task")
    labels = box.options  # AppTest gives the options as shown
    assert (
        len(set(labels))
        == len(labels)
        == sql(replication_db, "SELECT COUNT(DISTINCT task_id) FROM sample_results")[0][0]
    )
    # the demo, fidelity_cpu and replication variants, one more niah variant, and the one scored on its own traces
    assert sum(label.startswith("niah (longqa; ") for label in labels) == 5, labels
    assert "math500 (math; fidelity_reference=self)" in labels and "math500 (math)" in labels
    task, budget, _ = sql(
        replication_db,
        "SELECT task_id, budget, COUNT(*) FROM sample_results WHERE measure = 'generation' "
        "GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 LIMIT 1",
    )[0]
    assert (box.value, at.selectbox(key="sm_budget").value) == (task, budget)
    assert len(at.dataframe[0].value) > 1


def test_identical_methods_are_named(replication_db, monkeypatch):
    """On protocol #2's fidelity rows two method specs have the same KL, top-1 and ΔNLL on every sample
    (found here by comparing every pair of methods' rows); the page names exactly those."""
    rows = pd.DataFrame(
        sql(
            replication_db,
            "SELECT m.name, m.params, r.budget, r.task_id, r.sample_id, r.seed, "
            "r.kl_mean, r.top1_agreement, r.delta_nll_mean FROM sample_results r JOIN "
            "method_specs m ON m.id = r.method_spec_id WHERE r.measure = 'fidelity' AND "
            "r.protocol_id = 2",
        ),
        columns=["name", "params", "budget", "task", "sample", "seed", "kl", "top1", "dnll"],
    )
    per = {
        key: frozenset(map(tuple, g.drop(columns=["name", "params"]).itertuples(index=False)))
        for key, g in rows.groupby(["name", "params"])
    }
    same = [(a, b) for a in per for b in per if a < b and per[a] == per[b]]
    assert [(a[0], b[0]) for a, b in same] == [("epikv", "epikv_seg")]
    at = open_page(replication_db, "Budget curves", monkeypatch)
    at.radio(key="bc_measure").set_value("KL to full cache").run()
    box = at.selectbox(key="bc_fidelity_slice")
    box.select_index(next(i for i, o in enumerate(box.options) if "protocol #2:" in o)).run()
    warnings = [w.value for w in at.warning if w.value.startswith("Identical")]  # (the chart's own note too)
    # method names reach markdown escaped (model and method text renders as text, issue 45)
    assert len(warnings) == 1 and "epikv(series=generated) = epikv_seg" in warnings[0].replace("\\", ""), warnings


def test_cost_draws_accuracy_against_memory_only_where_memory_differs(replication_db, seeded_db, monkeypatch):
    for path in (replication_db, seeded_db):
        ((lo, hi),) = sql(
            path,
            "SELECT MIN(m), MAX(m) FROM (SELECT AVG(peak_kv_bytes) AS m FROM sample_results WHERE "
            "status = 'ok' AND measure = 'generation' GROUP BY method_spec_id, budget)",
        )
        at = open_page(path, "Cost", monkeypatch)
        drawn = any(json.dumps(spec).count('"peak KV MiB"') for spec, _ in charts(at))
        assert drawn == (hi >= 1.25 * lo), (path.name, lo, hi)
        assert drawn or any(c.value.startswith("Not drawn: every method and budget peaks at about") for c in at.caption)


def _shown(at: AppTest, *columns) -> list[tuple[pd.DataFrame, pd.DataFrame]]:
    """(values, the text a reader sees) of every table with ``columns``."""
    return [
        (d.value, chart_checks.arrow_frame(d.proto.arrow_data.styler.display_values))
        for d in at.dataframe
        if all(c in d.value.columns for c in columns)
    ]


def _two_significant(p: float) -> str | float:
    return "<0.001" if p < 1e-3 else float(f"{p:.2g}")


def assert_readable(values: pd.DataFrame, text: pd.DataFrame, p: tuple[str, ...], decimals: dict[str, int]) -> None:
    for c in p:
        for v, t in zip(values[c], text[c]):
            assert (t == "—") if pd.isna(v) else (t if t == "<0.001" else float(t)) == _two_significant(v), (c, v, t)
    for c, n in decimals.items():
        for v, t in zip(values[c], text[c]):
            assert t == ("—" if pd.isna(v) else f"{v:.{n}f}" if "Δ" not in c else f"{v:+.{n}f}"), (c, v, t)


def test_fidelity_tables_show_p_values_to_two_significant_digits(replication_db, monkeypatch):
    """p-values as the statistics pages write them (two significant digits, "<0.001" below), top-1 % to one
    decimal and KL to four, in every fidelity table: the leaderboard's at each budget with fidelity
    results and the scorecard's, read from what the tables display, not from the numbers underneath."""
    at = open_page(replication_db, "Leaderboard", monkeypatch)
    seen = 0
    for i in range(len(at.selectbox(key="lb_budget").options)):  # shown as "1,024 KV entries" or "prompt+64 KV entries"
        at.selectbox(key="lb_budget").select_index(i).run()
        assert not at.exception, at.exception
        for values, text in _shown(at, "KL 95% CI", "top-1 %"):
            assert_readable(values, text, (), {"KL": 4, "top-1 %": 1, "ΔNLL": 4})
            seen += 1
        for values, text in _shown(at, "p (Wilcoxon)", "Δ KL (A−B)"):
            assert_readable(
                values, text, ("p (Wilcoxon)", "p (adj.)"), {"KL A": 4, "KL B": 4, "Δ KL (A−B)": 4, "Δ top-1 (pts)": 1}
            )
            seen += 1
    at = open_page(replication_db, "Replication scorecard", monkeypatch)
    for values, text in _shown(at, "why fidelity", "p"):
        assert_readable(values, text, ("p", "p (adj.)"), {"KL": 4, "reference KL": 4, "Δ KL": 4})
        assert (values["p"] < 1e-3).any()  # the export's small p-values read "<0.001", not 0.000000
        seen += 1
    for values, text in _shown(at, "field", "p (Wilcoxon)"):
        assert_readable(values, text, ("p (Wilcoxon)", "p (adj.)"), {"KL A": 4, "KL B": 4, "Δ KL (B−A)": 4})
        seen += 1
    assert seen >= 4


def test_cost_intervals_equal_a_recomputation_from_the_rows(replication_db):
    """The Cost page's error bars (issue 50): tokens/s, a 95% t interval of the mean over samples; method
    overhead, the ratio of sums with the ratio estimator's standard error; both recomputed from the rows."""
    import numpy as np
    from scipy import stats as scipy_stats

    from kvleague.analysis import queries as q
    from kvleague.analysis import tables

    engine = get_engine(f"sqlite:///{replication_db}")
    df = tables.cost(engine, q.Filters()).set_index(["method", "budget"])
    raw = pd.DataFrame(
        sql(
            replication_db,
            "SELECT m.name, r.budget, r.tokens_per_second, COALESCE(r.method_seconds, 0), "
            "COALESCE(r.prefill_seconds, 0) + COALESCE(r.decode_seconds_mean * r.generated_tokens, 0) "
            "FROM sample_results r JOIN method_specs m ON m.id = r.method_spec_id "
            "WHERE r.status = 'ok' AND r.measure = 'generation'",
        ),
        columns=["method", "budget", "tps", "m", "t"],
    )
    checked = 0
    for (method, budget), g in raw.groupby(["method", "budget"]):
        if (method, budget) not in df.index or len(g) < 2:
            continue
        row = df.loc[(method, budget)]
        t = scipy_stats.t.ppf(0.975, len(g) - 1)
        half = t * g["tps"].std(ddof=1) / np.sqrt(len(g))
        assert row["tokens/s lo"] == pytest.approx(g["tps"].mean() - half, rel=1e-6, abs=1e-9)
        assert row["tokens/s hi"] == pytest.approx(g["tps"].mean() + half, rel=1e-6, abs=1e-9)
        ratio = g["m"].sum() / g["t"].sum()
        se = np.sqrt(((g["m"] - ratio * g["t"]) ** 2).sum() / (len(g) * (len(g) - 1))) / g["t"].mean()
        assert row["overhead lo"] == pytest.approx(100 * (ratio - t * se), rel=1e-6, abs=1e-9)
        assert row["overhead lo"] <= row["method overhead %"] <= row["overhead hi"]
        checked += 1
    assert checked >= 10


def test_cost_page_fits_its_tables_draws_error_bars_and_says_the_set_up(replication_db, monkeypatch):
    at = open_page(replication_db, "Cost", monkeypatch)
    from kvleague.analysis import queries as q
    from kvleague.analysis import tables

    cost_tables = [d.value for d in at.dataframe if "budget" in d.value.columns]
    assert len(cost_tables) == 3 and all(len(t.columns) <= 10 for t in cost_tables)
    every = tables.cost(get_engine(f"sqlite:///{replication_db}"), q.Filters()).columns
    assert {c for t in cost_tables for c in t.columns} == set(every) - {"pareto"}  # every column, in some table
    specs = [json.dumps(spec) for spec, _ in charts(at)]
    assert sum('"errorbar"' in s for s in specs) >= 2
    setup = [t.value for t in at.text]
    assert setup and all(
        line.startswith("sweep #") and "backend" in line and "workers x" in line for line in setup[0].splitlines()
    )


def test_every_method_has_its_own_colour_and_marker():
    """One mapping for every chart: the first seven colours (the demo's seven methods) of seven hue
    families, their CIELAB hue angles at least 25 degrees apart (tableau20's pairs, e.g. its two blues,
    are under 10), eight markers, so the demo's methods differ in both, and forty methods before a
    (colour, marker) pair repeats."""
    import itertools
    import math

    from kvleague.dashboard.views.common import METHOD_COLOURS, method_colour, method_shape, method_styles

    def hue(hex_colour: str) -> float:  # sRGB (D65) -> CIELAB -> hue angle
        lin = [
            (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4)
            for c in (int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
        ]
        xyz = [
            sum(w * c for w, c in zip(row, lin))
            for row in ((0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505))
        ]
        f = [
            t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (xyz[0] / 0.95047, xyz[1], xyz[2] / 1.08883)
        ]
        return math.degrees(math.atan2(200 * (f[1] - f[2]), 500 * (f[0] - f[1]))) % 360

    def closest(colours) -> float:
        return min(min(abs(hue(x) - hue(y)), 360 - abs(hue(x) - hue(y))) for x, y in itertools.combinations(colours, 2))

    assert closest(METHOD_COLOURS[:7]) >= 25
    assert closest(["#1f77b4", "#aec7e8"]) < 10 and closest(["#2ca02c", "#98df8a"]) < 10  # tableau20's pairs
    demo = ["full", "streaming_llm", "knorm", "h2o", "snapkv", "tova", "epikv"]
    styles = method_styles(demo)
    assert len({c for c, _ in styles.values()}) == len({s for _, s in styles.values()}) == 7
    assert len(set(method_styles([f"m{i}" for i in range(40)]).values())) == 40
    colour, shape = method_colour(demo).to_dict(), method_shape(demo).to_dict()
    assert dict(zip(colour["scale"]["domain"], colour["scale"]["range"])) == {m: c for m, (c, _) in styles.items()}
    assert dict(zip(shape["scale"]["domain"], shape["scale"]["range"])) == {m: s for m, (_, s) in styles.items()}


def test_curves_plot_ratio_budgets_against_the_ratio():
    """kvpress's ratio budgets (issue 48): Budget curves plot the score against the compression ratio."""
    from kvleague.dashboard.views.curves import _x, with_ratio

    data = pd.DataFrame({"budget": [250, 500], "accuracy": [50.0, 75.0]})
    ratios = with_ratio(data, {250: "ratio 0.25", 500: "ratio 0.5"})
    assert ratios["compression_ratio"].tolist() == [0.25, 0.5] and _x(ratios).shorthand == "compression_ratio:Q"
    assert "compression_ratio" not in with_ratio(data, {250: "250", 500: "500"})
