"""Serve the dashboard and drive it with headless Debian Chromium (python playwright with
``executable_path``; no browser is ever downloaded). Used by the browser test and to make
``docs/leaderboard.png``:

    python -m kvleague.dashboard.browser --db sqlite:///kvleague.db --out docs/leaderboard.png [--page leaderboard]

Needs the ``playwright`` package (``pip install -e ".[test]"``) and Chromium (``bash scripts/chromium.sh``).
A page is shot once the app has finished running and every chart has drawn; the charts' Vega-Lite
specs and data, as the server sent them, are read off the websocket (:class:`ChartSpy`) so that
:mod:`dashboard.chart_checks` can check what the browser drew.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvleague.dashboard.commands import streamlit_command
from kvleague.engine.errors import KvleagueError

if TYPE_CHECKING:
    from playwright.sync_api import ViewportSize

#: the ``?page=`` slugs, in the app's page order (dashboard.views.PAGES; not imported: that loads Streamlit)
PAGE_SLUGS = ("leaderboard", "budget-curves", "replication-scorecard", "cost", "samples", "provenance", "signals")

CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
#: headless, no sandbox (root in containers), and nothing that phones home
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)
VIEWPORT: ViewportSize = {"width": 1920, "height": 1250}


def find_chromium() -> str | None:
    for path in (os.environ.get("KVLEAGUE_CHROMIUM") or "", *CHROMIUM_PATHS):
        if path and os.access(path, os.X_OK):
            return path
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(db_url: str, log_path: str | Path, start_timeout_s: float = 90) -> Iterator[str]:
    """``streamlit run dashboard/app.py`` on 127.0.0.1 and a free port; yields the base URL; the server
    (its whole process group) is stopped on exit."""
    port = free_port()
    env = {**os.environ, "KVLEAGUE_DB": db_url, "HF_HUB_OFFLINE": "1", "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    log = Path(log_path)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            streamlit_command(port),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(base, proc, start_timeout_s, log)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def wait_until_serving(base: str, proc: subprocess.Popen, timeout_s: float, log: Path | None = None) -> None:
    """Return once Streamlit at ``base`` answers its health check; raise if ``proc`` exits or
    ``timeout_s`` passes first (with the end of ``log``, when given)."""
    tail = lambda: f":\n{log.read_text(errors='replace')[-3000:]}" if log is not None else ""  # noqa: E731
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode}{tail()}")
        try:
            with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"streamlit did not answer within {timeout_s:.0f}s{tail()}")
        time.sleep(0.3)


def check_browser() -> str:
    """Chromium's path; a one-line error when it or the playwright package is missing."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        raise KvleagueError(
            "browser: the playwright package is not installed (pip install -e '.[test]'); "
            "Chromium comes from bash scripts/chromium.sh"
        ) from None
    executable = find_chromium()
    if executable is None:
        raise KvleagueError(
            "browser: no chromium at /usr/bin/chromium (or $KVLEAGUE_CHROMIUM): run bash scripts/chromium.sh"
        )
    return executable


@contextlib.contextmanager
def chromium_page(profile_dir: str | Path, timeout_s: float = 90):
    """A page in headless Chromium with a fresh profile (``--user-data-dir``) in ``profile_dir``."""
    executable = check_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # playwright passes the profile as --user-data-dir itself (it refuses that flag in args)
        context = p.chromium.launch_persistent_context(
            str(profile_dir),
            executable_path=executable,
            headless=True,
            args=list(CHROMIUM_FLAGS),
            viewport=VIEWPORT,
            timeout=timeout_s * 1000,
        )
        try:
            page = context.new_page()
            page.set_default_timeout(timeout_s * 1000)
            yield page
        finally:
            context.close()


def wait_for_leaderboard(page, base: str) -> list[str]:
    """Open the leaderboard, wait until its tables are filled; return the grid cells' texts."""
    page.goto(f"{base}/?page=leaderboard")
    page.get_by_text("Per method and domain").wait_for()
    cells = page.locator("[data-testid='stDataFrame'] [id^='glide-cell']")
    cells.first.wait_for(state="attached")
    page.wait_for_timeout(1500)  # let the grids paint before a screenshot
    return [t.strip() for t in cells.all_text_contents()]


class ChartSpy:
    """What the server sends a page, read off its websocket: ``finished`` once the latest script run
    has ended (not cut short for a rerun), and ``charts``, the ``(spec, datasets)`` of every Vega-Lite
    chart that run drew."""

    def __init__(self, page) -> None:
        self.charts: list[tuple[dict, dict]] = []
        self.started = self.finished = False
        page.on("websocket", lambda ws: ws.on("framereceived", self._frame))

    def _frame(self, payload) -> None:
        import json

        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        from kvleague.dashboard.chart_checks import arrow_frame

        if isinstance(payload, str):
            return
        msg = ForwardMsg()
        try:
            msg.ParseFromString(payload)
        except Exception:
            return
        kind = msg.WhichOneof("type")
        if kind == "new_session":  # a script run starts
            self.charts, self.finished, self.started = [], False, True
        elif kind == "script_finished" and self.started:
            self.finished = msg.script_finished != ForwardMsg.FINISHED_EARLY_FOR_RERUN
        elif kind == "delta" and msg.delta.WhichOneof("type") == "new_element":
            element = msg.delta.new_element
            if element.WhichOneof("type") == "vega_lite_chart":
                chart = element.vega_lite_chart
                self.charts.append((json.loads(chart.spec), {d.name: arrow_frame(d.data.data) for d in chart.datasets}))


def open_page(page, base: str, slug: str, spy: ChartSpy, timeout_s: float = 120) -> None:
    """Open a page and wait until its script run is over (told by the server, not guessed from a
    spinner or a fixed wait) and every chart has drawn its SVG or canvas; an exception box is an error."""
    if slug not in PAGE_SLUGS:
        raise KvleagueError(f"--page: unknown {slug!r}; allowed: {', '.join(PAGE_SLUGS)}")
    spy.started = spy.finished = False  # frames of the page before do not count
    page.goto(f"{base}/?page={slug}")
    deadline = time.monotonic() + timeout_s
    while not spy.finished:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {slug} page was still running after {timeout_s:.0f}s")
        page.wait_for_timeout(100)
    page.locator("[data-testid='stStatusWidget']").wait_for(state="detached")
    # the browser mounts the run's elements after the server is done: wait until their number holds
    elements, last, steady = page.locator("[data-testid='stMain'] [data-testid='stElementContainer']"), -1, 0
    while steady < 3:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {slug} page's elements were still changing after {timeout_s:.0f}s")
        n = elements.count()
        steady, last = (steady + 1, n) if n == last else (0, n)
        page.wait_for_timeout(200)
    for chart in page.locator("[data-testid='stVegaLiteChart']").all():
        chart.locator("svg.marks, canvas.marks").first.wait_for()
    if page.locator("[data-testid='stException']").count():
        raise RuntimeError(f"the {slug} page shows an exception: {page.inner_text('body')[:500]}")


def screenshot(db_url: str, out: str | Path, page_slug: str = "leaderboard") -> Path:
    if page_slug not in PAGE_SLUGS:
        raise KvleagueError(f"--page: unknown {page_slug!r}; allowed: {', '.join(PAGE_SLUGS)}")
    check_browser()  # before Streamlit starts
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvleague-shot-") as tmp:
        with serve(db_url, Path(tmp) / "streamlit.log") as base, chromium_page(Path(tmp) / "profile") as page:
            open_page(page, base, page_slug, ChartSpy(page))
            if page_slug == "leaderboard":
                wait_for_leaderboard(page, base)
            page.screenshot(path=str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    import sys

    from kvleague.dashboard.commands import resolve_db
    from kvleague.engine.errors import OneLineParser

    p = OneLineParser(
        prog="python -m kvleague.dashboard.browser", description="Screenshot a dashboard page in headless Chromium."
    )
    p.add_argument("--db", default=None, help="database URL (default: as kvleague dashboard)")
    p.add_argument("--out", required=True)
    p.add_argument("--page", default="leaderboard", choices=PAGE_SLUGS, help=", ".join(PAGE_SLUGS))
    try:
        args = p.parse_args(argv)
        print(screenshot(resolve_db(args.db), args.out, args.page))
    except KvleagueError as exc:
        print(f"{p.prog}: error: {str(exc).removeprefix(p.prog + ': ')}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
