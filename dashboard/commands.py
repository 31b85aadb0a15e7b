"""``kvleague dashboard [--db URL] [--port P]``: serve the Streamlit leaderboard on 127.0.0.1; ``kvleague report``:
the replication report (markdown + figures) of a database or an export.

One of ``kvleague.cli.COMMAND_GROUPS`` (``register(subparsers)``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvleague.engine.errors import KvleagueError

APP = Path(__file__).resolve().parent / "app.py"
HOST = "127.0.0.1"
DEFAULT_PORT = 8501


def streamlit_command(port: int, host: str = HOST, python: str | None = None) -> list[str]:
    """The server's command line. It names no database: the URL may hold a password, and every local
    user can read a command line (``ps``); the app reads ``$KVLEAGUE_DB``, which the caller sets."""
    return [
        python or sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--client.toolbarMode",
        "viewer",
    ]


def resolve_db(url: str | None) -> str:
    """The URL the dashboard will open (relative SQLite paths made absolute), checked up front."""
    from kvleague.analysis.queries import resolve_url
    from kvleague.db.session import parse_url

    parsed = parse_url(resolve_url(url))
    if parsed.get_backend_name() == "sqlite":
        path = Path(parsed.database or "")
        if not path.is_file():
            raise KvleagueError(
                f"dashboard: no SQLite database at {str(path)!r}; run a sweep first (kvleague sweep --config ...)"
            )
    resolved = parsed.render_as_string(hide_password=False)
    _readable(resolved)
    return resolved


def _readable(url: str) -> None:
    """Open the database read-only once: one that cannot be opened (a read-only directory holding a WAL
    database, a server refusing us) is one line here, not a traceback later."""
    from sqlalchemy.exc import SQLAlchemyError

    from kvleague.analysis.queries import has_schema, open_readonly
    from kvleague.db.session import display_url, error_reason, storage_fault

    engine = open_readonly(url)
    try:
        has_schema(engine)
    except SQLAlchemyError as exc:
        raise KvleagueError(f"database: {display_url(url)}: {storage_fault(exc) or error_reason(exc)}") from None
    finally:
        engine.dispose()


def check_port(port: int, host: str = HOST) -> None:
    """A one-line error when ``host:port`` is taken: bound as Streamlit's server binds it (address reuse
    on, so a closed connection's TIME_WAIT does not count), which fails only while something listens."""
    import errno
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise KvleagueError(
                f"--port: {host}:{port} is in use (another dashboard?); stop it or choose another, e.g. --port {port + 1}"
            ) from None


def cmd_dashboard(args) -> int:
    if not 1 <= args.port <= 65535:
        raise KvleagueError(f"--port: must be 1-65535, got {args.port}")
    check_port(args.port)
    url = resolve_db(args.db)
    try:
        import streamlit  # noqa: F401
    except ImportError:
        raise KvleagueError("dashboard: streamlit is not installed (pip install -e .)") from None
    from kvleague.db.session import display_url

    print(f"kvleague dashboard: {display_url(url)} (read-only) at http://{HOST}:{args.port}", flush=True)
    env = {**os.environ, "KVLEAGUE_DB": url}
    proc = subprocess.Popen(streamlit_command(args.port), env=env)
    # stopping the command (Ctrl-C, or SIGTERM from a supervisor or `kill`) stops the server it started
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        _stop(proc)
        return 130
    except _Terminated:
        _stop(proc)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Terminated(Exception):
    """SIGTERM arrived while the dashboard ran."""


def _terminated(signum, frame) -> None:
    raise _Terminated


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _preamble(path: str | None) -> str:
    if path is None:
        return ""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvleagueError(f"--preamble: cannot read {path!r}: {exc.__class__.__name__}") from None


def cmd_report(args) -> int:
    import tempfile

    from kvleague.analysis.queries import has_schema, open_readonly
    from kvleague.db.session import display_url, get_engine

    if (args.db is None) == (args.export is None):
        raise KvleagueError("report: give one of --db URL (a database) or --export FILE (a kvleague db export)")
    preamble = _preamble(args.preamble)
    with tempfile.TemporaryDirectory(prefix="kvleague-report-") as scratch:
        if args.export is not None:  # the export into a scratch SQLite file: the report never needs a server
            from kvleague.db.transfer import import_

            url = f"sqlite:///{Path(scratch) / 'import.db'}"
            import_(get_engine(url), args.export)
            source = args.source or f"the export {Path(args.export).name}"
        else:
            url = resolve_db(args.db)
            source = args.source or display_url(url)
        engine = open_readonly(url)
        if not has_schema(engine):
            raise KvleagueError(
                f"report: {display_url(url)} holds no kvleague results; run a sweep or kvleague db import first"
            )
        from kvleague.analysis.report import build  # after the database is known good: it loads matplotlib

        path = build(engine, args.out, source=source, preamble=preamble)
        engine.dispose()
    print(path)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("dashboard", help="serve the leaderboard (Streamlit) on 127.0.0.1")
    p.add_argument(
        "--db", default=None, help="database URL (default: $KVLEAGUE_DB, else sqlite:///kvleague.db); opened read-only"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port on 127.0.0.1 (default {DEFAULT_PORT})")
    p.set_defaults(func=cmd_dashboard)

    p = subparsers.add_parser(
        "report", help="write the replication report (markdown + PNG figures) from a database or an export"
    )
    p.add_argument("--db", default=None, help="database URL; opened read-only")
    p.add_argument(
        "--export", default=None, help="a file written by kvleague db export (imported into a scratch SQLite)"
    )
    p.add_argument("--out", required=True, help="directory for replication.md and replication_figures/")
    p.add_argument("--preamble", default=None, help="a markdown file placed before the findings (what the data is)")
    p.add_argument(
        "--source", default=None, help="how the report names its data (default: the database URL or export file name)"
    )
    p.set_defaults(func=cmd_report)
