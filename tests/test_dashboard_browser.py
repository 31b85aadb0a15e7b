"""A real browser on the real server: ``streamlit run dashboard/app.py`` on 127.0.0.1 (a free port),
the leaderboard opened in headless Debian Chromium (python playwright driving /usr/bin/chromium; no
browser is downloaded), method names and numbers checked against values computed here from the
seeded rows, no exception box, and a screenshot saved (to the test's tmp dir, and to
``$KVLEAGUE_SCREENSHOT`` when set - ``docs/leaderboard.png`` is made that way).

Skipped only when Chromium (or playwright) is missing and ``$CI`` is unset; under CI it must run
(``.ci/run`` installs chromium with ``scripts/chromium.sh``).
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from dashboard.browser import CHROMIUM_FLAGS, chromium_page, find_chromium, serve, wait_for_leaderboard

CHROMIUM = find_chromium()
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")

try:
    import playwright.sync_api  # noqa: F401
    HAVE_PLAYWRIGHT = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_PLAYWRIGHT = False

if not IN_CI and (CHROMIUM is None or not HAVE_PLAYWRIGHT):
    pytest.skip("needs Debian chromium (bash scripts/chromium.sh) and the playwright package; CI always runs this",
                allow_module_level=True)

sm_proportion = pytest.importorskip("statsmodels.stats.proportion")

from dashboard import seed  # noqa: E402
from dashboard.seed import RealisticSpec, Seeder, realistic_rows  # noqa: E402
from db.session import get_engine  # noqa: E402

#: the seeder's tasks with fewer problems (a quick screenshot database)
PROBLEMS = {"math500": 100, "aime24": 30, "humaneval": 80, "kv_agent": 60, "niah": 60}
TASKS = tuple((name, domain, PROBLEMS[name], acc, typical) for name, domain, _, acc, typical in seed.TASKS)
BUDGET = 4096  # the middle of (1024, 2048, 4096, 8192): what the leaderboard opens on


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
        pytest.fail("CI is set but chromium or playwright is missing: run bash scripts/chromium.sh and pip install -e '.[test]'")
    url, rows, spec = realistic_db
    domain_of = {t[0]: t[1] for t in spec.tasks}
    # expected numbers for the first domain column (agentic: kv_agent) and every method, from the raw rows
    from db.models import MethodSpec, TaskSpec
    from sqlalchemy import select

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
