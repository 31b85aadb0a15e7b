"""Serve the dashboard and drive it with headless Debian Chromium (python playwright with
``executable_path``; no browser is ever downloaded). Used by the browser test and to make
``docs/leaderboard.png``:

    python -m dashboard.browser --db sqlite:///kvleague.db --out docs/leaderboard.png [--page leaderboard]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from dashboard.commands import streamlit_command

CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
#: headless, no sandbox (root in containers), and nothing that phones home
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
)
VIEWPORT = {"width": 1920, "height": 1250}


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
        proc = subprocess.Popen(streamlit_command(db_url, port), env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"streamlit did not answer within {start_timeout_s:.0f}s:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.3)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@contextlib.contextmanager
def chromium_page(profile_dir: str | Path, timeout_s: float = 90):
    """A page in headless Chromium with a fresh profile (``--user-data-dir``) in ``profile_dir``."""
    from playwright.sync_api import sync_playwright

    executable = find_chromium()
    if executable is None:
        raise RuntimeError("no chromium at /usr/bin/chromium: run bash scripts/chromium.sh")
    with sync_playwright() as p:
        # playwright passes the profile as --user-data-dir itself (it refuses that flag in args)
        context = p.chromium.launch_persistent_context(
            str(profile_dir), executable_path=executable, headless=True, args=list(CHROMIUM_FLAGS),
            viewport=VIEWPORT, timeout=timeout_s * 1000,
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


def screenshot(db_url: str, out: str | Path, page_slug: str = "leaderboard") -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvleague-shot-") as tmp:
        with serve(db_url, Path(tmp) / "streamlit.log") as base, chromium_page(Path(tmp) / "profile") as page:
            if page_slug == "leaderboard":
                wait_for_leaderboard(page, base)
            else:
                page.goto(f"{base}/?page={page_slug}")
                page.locator("h1").first.wait_for()
                page.wait_for_timeout(4000)
            if page.locator("[data-testid='stException']").count():
                raise RuntimeError("the page shows an exception")
            page.screenshot(path=str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    from dashboard.commands import resolve_db

    p = argparse.ArgumentParser(prog="python -m dashboard.browser", description="Screenshot a dashboard page in headless Chromium.")
    p.add_argument("--db", default=None, help="database URL (default: as kvleague dashboard)")
    p.add_argument("--out", required=True)
    p.add_argument("--page", default="leaderboard", help="leaderboard, budget-curves, replication-scorecard, cost, samples, provenance")
    args = p.parse_args(argv)
    print(screenshot(resolve_db(args.db), args.out, args.page))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
