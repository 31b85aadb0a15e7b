"""``kvleague dashboard`` and the dashboard's read-only database access."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from kvleague.analysis import queries as q
from kvleague.dashboard import commands
from kvleague.db.seed import Seeder
from kvleague.db.session import get_engine
from kvleague.engine.errors import KvleagueError


@pytest.fixture
def small_db(tmp_path) -> str:
    url = f"sqlite:///{tmp_path}/small.db"
    engine = get_engine(url)
    s = Seeder(engine)
    ids = dict(
        model_id=s.model("m"),
        task_id=s.task("math500", "math"),
        protocol_id=s.protocol(),
        generation_id=s.generation(),
        sweep_id=s.sweep("small"),
        sample_index=0,
        seed=0,
    )
    a, b = s.method("h2o", {"window": 8}), s.method("h2o", {"window": 16})
    full = s.method("full")
    rows = []
    for budget in (64, 128):
        for i in range(6):
            rows.append(
                {
                    **ids,
                    "budget": budget,
                    "method_spec_id": full,
                    "sample_id": f"p{i}",
                    "correct": i < 4,
                    "evictions": 0,
                }
            )
            rows.append(
                {**ids, "budget": budget, "method_spec_id": a, "sample_id": f"p{i}", "correct": i < 2, "evictions": i}
            )
            rows.append(
                {
                    **ids,
                    "budget": budget,
                    "method_spec_id": b,
                    "sample_id": f"p{i}",
                    "correct": i in (0, 4),
                    "evictions": 1,
                }
            )
    s.write(rows)
    engine.dispose()
    return url


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvleague")
    sub = parser.add_subparsers(dest="command", required=True)
    commands.register(sub)
    return parser


def test_register_and_parse():
    args = _parser().parse_args(["dashboard", "--db", "sqlite:///x.db", "--port", "9123"])
    assert (args.db, args.port, args.func) == ("sqlite:///x.db", 9123, commands.cmd_dashboard)
    assert _parser().parse_args(["dashboard"]).port == commands.DEFAULT_PORT


def test_streamlit_command_binds_localhost():
    cmd = commands.streamlit_command(8600, python="py")
    assert cmd[:4] == ["py", "-m", "streamlit", "run"]
    assert cmd[4] == str(commands.APP) and Path(cmd[4]).is_file()
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--server.port") + 1] == "8600"
    assert cmd[cmd.index("--server.headless") + 1] == "true"


def test_cmd_dashboard_runs_streamlit(small_db, monkeypatch):
    seen = {}

    class FakeProc:
        def __init__(self, cmd, env):
            seen.update(cmd=cmd, env=env)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(commands.subprocess, "Popen", FakeProc)
    args = _parser().parse_args(["dashboard", "--db", small_db, "--port", "8777"])
    assert commands.cmd_dashboard(args) == 0
    assert seen["env"]["KVLEAGUE_DB"] == small_db and "--db" not in seen["cmd"]
    assert seen["cmd"][seen["cmd"].index("--server.port") + 1] == "8777"


def test_cmd_dashboard_keeps_the_password_out_of_argv(monkeypatch):
    """A PostgreSQL URL's password reaches the Streamlit child through its environment, never its
    command line (which every local user reads in ps)."""
    seen = {}

    class FakeProc:
        def __init__(self, cmd, env):
            seen.update(cmd=cmd, env=env)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(commands.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(commands, "_readable", lambda url: None)  # no server here: the argv is the point
    url = "postgresql+psycopg://kvleague:s3cret-pw@127.0.0.1:5432/kvleague"
    assert commands.cmd_dashboard(_parser().parse_args(["dashboard", "--db", url])) == 0
    assert not any("s3cret-pw" in part for part in seen["cmd"])
    assert seen["env"]["KVLEAGUE_DB"] == url


def test_a_port_in_use_is_one_line_before_anything_else(small_db, monkeypatch, capsys):
    """A port something listens on (a socket here, as a running dashboard's would be): the command says
    so and suggests --port, before printing its address or starting Streamlit (issue 50)."""
    import socket

    from kvleague.cli import main

    monkeypatch.setattr(commands.subprocess, "Popen", lambda *a, **k: pytest.fail("Streamlit started"))
    with socket.socket() as taken:
        taken.bind((commands.HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["dashboard", "--db", small_db, "--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"kvleague: error: --port: {commands.HOST}:{port} is in use (another dashboard?); stop it or choose "
        f"another, e.g. --port {port + 1}\n"
    )
    commands.check_port(port)  # closed: free again


def test_cmd_dashboard_errors(tmp_path, monkeypatch):
    with pytest.raises(KvleagueError, match="--port"):
        commands.cmd_dashboard(_parser().parse_args(["dashboard", "--port", "70000"]))
    with pytest.raises(KvleagueError, match="no SQLite database"):
        commands.cmd_dashboard(_parser().parse_args(["dashboard", "--db", f"sqlite:///{tmp_path}/missing.db"]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVLEAGUE_DB", raising=False)
    with pytest.raises(KvleagueError, match="kvleague.db"):  # the default, resolved against the working directory
        commands.resolve_db(None)


def test_url_resolution_order(monkeypatch):
    monkeypatch.delenv("KVLEAGUE_DB", raising=False)
    assert q.resolve_url(None) == "sqlite:///kvleague.db"
    monkeypatch.setenv("KVLEAGUE_DB", "sqlite:///b.db")
    assert q.resolve_url(None) == "sqlite:///b.db"
    assert q.resolve_url("sqlite:///c.db") == "sqlite:///c.db"


def test_cli_entry(tmp_path, capsys):
    from kvleague import cli

    assert cli.main(["dashboard", "--db", f"sqlite:///{tmp_path}/missing.db"]) == 2
    assert "no SQLite database" in capsys.readouterr().err


def test_readonly_engine_cannot_write(small_db, tmp_path):
    engine = q.open_readonly(small_db)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sample_results")).scalar() == 36
        with pytest.raises(OperationalError, match="readonly|read-only|query_only"):
            conn.execute(text("DELETE FROM sample_results"))
    assert q.fingerprint(engine) == (36, 36)
    with pytest.raises(KvleagueError, match="no SQLite file"):
        q.open_readonly(f"sqlite:///{tmp_path}/absent.db")
    assert not (tmp_path / "absent.db").exists()
    with pytest.raises(KvleagueError, match="in-memory"):
        q.open_readonly("sqlite:///:memory:")


def test_question_cells_match_brute_force(small_db):
    engine = q.open_readonly(small_db)
    dims = q.dimensions(engine)
    labels = {m["label"] for m in dims["methods"].values()}
    assert labels == {"full", "h2o(window=8)", "h2o(window=16)"}  # only the differing hyperparameter
    by_label = {m["label"]: i for i, m in dims["methods"].items()}
    cells = [dict(zip(q.QUESTION_CELL_COLUMNS, r)) for r in q.question_cells(engine, q.Filters(), [64])]
    got = {(r["method_spec_id"], r["sample_id"]): (r["k"], r["m"], r["failed"], r["fired"]) for r in cells}
    assert len(got) == len(cells) == 18
    for i in range(6):  # full right on p0-p3, h2o(8) on p0, p1 (evictions = i), h2o(16) on p0, p4 (always evicts)
        assert got[(by_label["full"], f"p{i}")] == (int(i < 4), 1, 0, 0)
        assert got[(by_label["h2o(window=8)"], f"p{i}")] == (int(i < 2), 1, 0, int(i > 0))
        assert got[(by_label["h2o(window=16)"], f"p{i}")] == (int(i in (0, 4)), 1, 0, 1)
    keys = [
        tuple(
            r[k]
            for k in ("method_spec_id", "budget", "model_id", "task_id", "protocol_id", "generation_id", "sample_id")
        )
        for r in cells
    ]
    assert keys == sorted(keys)  # a fixed order, whatever the database returns
    # filters: budget, decoding, domain, nothing selected
    assert {r[1] for r in q.question_cells(engine, q.Filters(budgets=(128,)))} == {128}
    assert q.question_cells(engine, q.Filters(decoding=("sampled",)), [64]) == []
    assert q.question_cells(engine, q.Filters(domains=("code",)), [64]) == []
    assert q.question_cells(engine, q.Filters(models=()), [64]) == []
    assert q.method_budgets(engine, q.Filters(), [by_label["full"]]) == {64: 6, 128: 6}


def test_sigterm_to_the_dashboard_stops_its_streamlit_server(small_db):
    """`kvleague dashboard` runs Streamlit as a child; SIGTERM to the command (what `kill` and process
    supervisors send) must stop that child too, not leave it serving the port."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from kvleague.dashboard.browser import free_port, wait_until_serving

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvleague.cli", "dashboard", "--db", small_db, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children: list[int] = []
    try:
        wait_until_serving(f"http://127.0.0.1:{port}", proc, 90)
        children = [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert children, "streamlit runs as a child of the command"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        for child in children:  # gone, not a zombie re-parented and still serving
            deadline = time.monotonic() + 15
            while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not Path(f"/proc/{child}").exists(), f"streamlit (pid {child}) outlived the command"
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in children:
            if Path(f"/proc/{child}").exists():
                os.kill(child, signal.SIGKILL)
