"""A store that cannot take writes (issue 45): a disk that fills mid-sweep and a read-only database are
one line everywhere (the sweep, ``kvleague dashboard``, ``kvleague report --db``), and a sweep that
stops on them is marked stopped, not left ``running``. As root the disk is a real tmpfs (full, then
remounted read-only); elsewhere SQLite's ``max_page_count`` and file modes stand in."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import event, text

from kvleague.cli import main
from kvleague.db.seed import RealisticSpec, Seeder, realistic_rows
from kvleague.db.session import dispose_engines, get_engine
from kvleague.engine.errors import KvleagueError
from kvleague.runner.sweep import SweepRunner
from kvleague.runner.sweep_config import parse_config


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` at ``path`` (root only); None where it cannot be mounted."""
    path.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode
    ):
        yield None
        return
    try:
        yield path
    finally:
        dispose_engines()
        subprocess.run(["umount", "-l", str(path)], check=False)


class FakeScheduler:
    """Finishes every cell at once with a long completion (fills a small disk fast)."""

    git = None

    def run(self, groups, record, tick, batch_size):
        for group in groups:
            for cell in group:
                record(
                    cell,
                    {"cell_key": cell.key, "status": "ok", "correct": True, "score": 1.0, "completion": "y" * 20_000},
                )
                tick()

    def shutdown(self):
        pass


def _sweep(url: str, base_dir: Path) -> SweepRunner:
    cfg = parse_config(
        {
            "name": "full-disk",
            "database": url,
            "models": [{"source": "org/never-loaded", "name": "tiny", "dtype": "float32"}],  # the fake runs no model
            "methods": ["full"],
            "budgets": [64],
            "tasks": [{"name": "kv_agent", "limit": 200, "max_new_tokens": 2}],
            "seeds": [0],
            "resources": {"workers": 1, "batch_size": 1, "flush_seconds": 0.001},
        }
    )
    runner = SweepRunner(cfg, db_url=url, progress=False, base_dir=base_dir)
    runner.scheduler = FakeScheduler()
    return runner


@pytest.mark.parametrize("disk", ["tmpfs", "max_page_count"])
def test_a_disk_that_fills_mid_sweep_is_one_line_and_the_sweep_is_marked_stopped(disk, tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as mounted:
        if disk == "tmpfs" and mounted is None:
            pytest.skip("a tmpfs needs root (mount); max_page_count covers it elsewhere")
        url = f"sqlite:///{tmp_path / 'disk' / 'r.db'}"
        if disk == "max_page_count":  # the database may not grow past its size after the sweep's first rows
            engine = get_engine(url)
            event.listen(engine, "connect", lambda conn, _: conn.execute("PRAGMA max_page_count = 120"))
        runner = _sweep(url, tmp_path)
        with pytest.raises(KvleagueError) as err:
            runner.run()
        message = str(err.value)
        assert "\n" not in message and "the disk is full" in message and "run the same command again" in message
        with get_engine(url).connect() as conn:
            status = conn.execute(text("SELECT status FROM sweeps")).scalar_one()
            stored = conn.execute(text("SELECT count(*) FROM sample_results")).scalar()
        assert status == "stopped" and 0 < stored < 200


@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` made read-only: remounted so as root (permissions do not bind root), chmod elsewhere."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True)
        yield
        return
    files = [directory, *directory.iterdir()]
    for f in files:
        f.chmod(0o555 if f.is_dir() else 0o444)
    try:
        yield
    finally:
        for f in files:
            f.chmod(0o755 if f.is_dir() else 0o644)


def test_a_read_only_database_is_one_line_for_the_dashboard_and_the_report(tmp_path, capsys):
    from kvleague.dashboard import commands

    with tmpfs(tmp_path / "ro", "64m") as mounted:
        if os.geteuid() == 0 and mounted is None:
            pytest.skip("root cannot be refused by file modes and no tmpfs could be mounted")
        url = f"sqlite:///{tmp_path / 'ro' / 'r.db'}"
        s = Seeder(get_engine(url))
        s.write(
            realistic_rows(
                s, RealisticSpec(tasks=(("math500", "math", 2, 0.7, 300),), budgets=(128,), methods=("full",))
            )
        )
        dispose_engines()
        with read_only(tmp_path / "ro"):
            with pytest.raises(KvleagueError) as err:
                commands.resolve_db(url)  # what kvleague dashboard opens before it starts Streamlit
            assert "\n" not in str(err.value) and str(err.value).startswith("database: ")
            assert main(["report", "--db", url, "--out", str(tmp_path / "report")]) == 2
            assert main(["dashboard", "--db", url]) == 2
            err_lines = capsys.readouterr().err.strip().splitlines()
            assert len(err_lines) == 2 and all(line.startswith("kvleague: error: database: ") for line in err_lines)


def test_an_export_onto_a_full_disk_is_one_line(tmp_path, capsys):
    with tmpfs(tmp_path / "full", "64k") as mounted:
        if mounted is None:
            pytest.skip("a full disk needs a tmpfs, which needs root (mount)")
        url = f"sqlite:///{tmp_path / 'r.db'}"
        s = Seeder(get_engine(url))
        s.write(
            realistic_rows(
                s, RealisticSpec(tasks=(("math500", "math", 2, 0.7, 300),), budgets=(128,), methods=("full",))
            )
        )
        with contextlib.suppress(OSError):
            (mounted / "filler").write_bytes(b"x" * 65_536)  # the whole disk
        assert main(["db", "export", "--db", url, "--out", str(mounted / "r.jsonl.gz")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "No space left on device" in err, err
