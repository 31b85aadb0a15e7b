"""A real browser on the real server: ``streamlit run dashboard/app.py`` on 127.0.0.1 (a free port),
the leaderboard opened in headless Debian Chromium (python playwright driving /usr/bin/chromium; no
browser is downloaded), method names and numbers checked against values computed here from the
seeded rows, no exception box, and a screenshot saved (to the test's tmp dir, and to
``$KVLEAGUE_SCREENSHOT`` when set - ``docs/leaderboard.png`` is made that way). Then every page, on
the seeded database and on the committed replication export: shot once it has finished running,
with the charts' specs as the server sent them checked (:mod:`dashboard.chart_checks`: no line
across protocols, no cut legend), every legend label drawn inside its chart, and data in view.

Skipped only when Chromium (or playwright) is missing and ``$CI`` is unset; under CI it must run
(``.ci/run`` installs chromium with ``scripts/chromium.sh``).
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from kvleague.dashboard.browser import (
    CHROMIUM_FLAGS,
    PAGE_SLUGS,
    ChartSpy,
    chromium_page,
    find_chromium,
    open_page,
    serve,
    wait_for_leaderboard,
)

CHROMIUM = find_chromium()
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")

try:
    import playwright.sync_api  # noqa: F401

    HAVE_PLAYWRIGHT = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_PLAYWRIGHT = False

if not IN_CI and (CHROMIUM is None or not HAVE_PLAYWRIGHT):
    pytest.skip(
        "needs Debian chromium (bash scripts/chromium.sh) and the playwright package; CI always runs this",
        allow_module_level=True,
    )

sm_proportion = pytest.importorskip("statsmodels.stats.proportion")

from kvleague.db import seed  # noqa: E402
from kvleague.db.seed import RealisticSpec, Seeder, realistic_rows  # noqa: E402
from kvleague.db.session import get_engine  # noqa: E402

# minutes of Ray, subprocesses or a browser: the slow tier (KVLEAGUE_SLOW=1 bash scripts/test.sh)
pytestmark = pytest.mark.slow

#: the seeder's tasks with fewer problems (a quick screenshot database)
PROBLEMS = {"math500": 100, "aime24": 30, "humaneval": 80, "kv_agent": 60, "niah": 60}
TASKS = tuple((name, domain, PROBLEMS[name], acc, typical) for name, domain, _, acc, typical in seed.TASKS)
BUDGET = 1024  # every budget has as many results: the leaderboard opens on the first with the most


@pytest.fixture(scope="module")
def realistic_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("browser") / "leaderboard.db"
    engine = get_engine(f"sqlite:///{path}")
    s = Seeder(engine)
    spec = RealisticSpec(tasks=TASKS, sweep="realistic-demo", fail_rate=0.0)
    rows = list(realistic_rows(s, spec))
    s.write([dict(r) for r in rows])
    engine.dispose()
    return f"sqlite:///{path}", rows, spec


@pytest.fixture(scope="module")
def server(realistic_db, tmp_path_factory):
    url, _, _ = realistic_db
    with serve(url, tmp_path_factory.mktemp("server") / "streamlit.log") as base:
        yield base


def test_leaderboard_in_chromium(server, realistic_db, tmp_path):
    if CHROMIUM is None or not HAVE_PLAYWRIGHT:
        pytest.fail(
            "CI is set but chromium or playwright is missing: run bash scripts/chromium.sh and pip install -e '.[test]'"
        )
    url, rows, spec = realistic_db
    domain_of = {t[0]: t[1] for t in spec.tasks}
    # expected numbers for the first domain column (agentic: kv_agent) and every method, from the raw rows
    from sqlalchemy import select

    from kvleague.db.models import MethodSpec, TaskSpec

    engine = get_engine(url)
    with engine.connect() as conn:
        method_name = dict(conn.execute(select(MethodSpec.id, MethodSpec.name)).all())
        task_name = dict(conn.execute(select(TaskSpec.id, TaskSpec.name)).all())
    engine.dispose()
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        if r["status"] == "ok" and r["budget"] == BUDGET:
            c = counts[(method_name[r["method_spec_id"]], domain_of[task_name[r["task_id"]]])]
            c[0] += int(r["correct"])
            c[1] += 1
    expected_ci = {}
    expected_acc = {}
    for method in spec.methods:
        k, n = counts[(method, "agentic")]
        lo, hi = sm_proportion.proportion_confint(k, n, alpha=0.05, method="wilson")
        expected_ci[method] = f"[{100 * lo:.1f}, {100 * hi:.1f}]"
        expected_acc[method] = 100 * k / n

    assert {"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"} <= set(CHROMIUM_FLAGS)
    shot = tmp_path / "leaderboard.png"
    with chromium_page(tmp_path / "chromium-profile") as page:
        texts = wait_for_leaderboard(page, server)
        body = page.inner_text("body")
        assert page.locator("[data-testid='stException']").count() == 0, body[:2000]
        assert "Traceback" not in body
        assert "Leaderboard" in body and f"{BUDGET:,} KV entries" in body
        for method in spec.methods:
            assert method in texts, (method, texts[:60])
            assert expected_ci[method] in texts, (method, expected_ci[method], texts[:80])
        numbers = []
        for t in texts:
            try:
                numbers.append(float(t))
            except ValueError:
                pass
        for method, acc in expected_acc.items():  # shown as 48.3 (the grid's text may be the raw value)
            assert f"{acc:.1f}" in texts or any(abs(x - acc) < 1e-6 for x in numbers), (method, acc, texts[:80])
        page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    target = os.environ.get("KVLEAGUE_SCREENSHOT")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)


@pytest.fixture(scope="module")
def replication_url(tmp_path_factory):
    from kvleague.db.transfer import import_
    from tests.conftest import REPO

    path = tmp_path_factory.mktemp("browser-replication") / "replication.db"
    engine = get_engine(f"sqlite:///{path}")
    import_(engine, REPO / "results" / "replication.jsonl.gz")
    engine.dispose()
    return f"sqlite:///{path}"


def _legend_labels_outside(page) -> list[str]:
    """Legend labels of every chart that are drawn outside the chart's own box (cut off on screen)."""
    out = []
    for chart in page.locator("[data-testid='stVegaLiteChart']").all():
        box = chart.bounding_box()
        for label in chart.locator("g.role-legend-label text").all():
            b = label.bounding_box()
            if (
                b is None
                or b["y"] + b["height"] > box["y"] + box["height"] + 1
                or b["x"] + b["width"] > box["x"] + box["width"] + 1
            ):
                out.append(label.text_content())
    return out


@pytest.mark.parametrize("db", ["seeded", "replication"])
def test_every_page_in_chromium(db, realistic_db, replication_url, tmp_path, tmp_path_factory):
    from kvleague.dashboard import chart_checks
    from kvleague.dashboard.ui import SLUGS

    if CHROMIUM is None or not HAVE_PLAYWRIGHT:
        pytest.fail(
            "CI is set but chromium or playwright is missing: run bash scripts/chromium.sh and pip install -e '.[test]'"
        )
    assert PAGE_SLUGS == tuple(SLUGS.values())
    url = realistic_db[0] if db == "seeded" else replication_url
    with (
        serve(url, tmp_path_factory.mktemp("server") / "streamlit.log") as base,
        chromium_page(tmp_path / "chromium-profile") as page,
    ):
        spy = ChartSpy(page)
        for slug in PAGE_SLUGS:
            open_page(page, base, slug, spy)
            body = page.inner_text("body")
            assert page.locator("[data-testid='stStatusWidget']").count() == 0, slug
            if slug == "signals" and db == "seeded":
                assert "No signal studies stored yet" in body
                continue
            alerts = [a.inner_text() for a in page.locator("[data-testid='stAlert']").all()]
            assert not [a for a in alerts if "match" in a], (slug, alerts)
            # a table's grid is code the browser loads on first use: under load it can mount after the
            # page's elements have settled (a page without any fails here, as below)
            page.locator("[data-testid='stDataFrame'], [data-testid='stVegaLiteChart']").first.wait_for(timeout=60_000)
            grids = page.locator("[data-testid='stDataFrame']").count()
            drawn = page.locator("[data-testid='stVegaLiteChart']").count()
            assert grids + drawn > 0, (slug, body[-1500:])
            assert len(spy.charts) == drawn, (slug, len(spy.charts), drawn)
            for spec, data in spy.charts:
                assert chart_checks.problems(spec, data) == [], slug
            assert _legend_labels_outside(page) == [], slug
            page.screenshot(path=str(tmp_path / f"{db}-{slug}.png"))
