"""Database helpers for the test-suite: a PostgreSQL server started once per process, fresh databases.

``postgres_server_url()``: ``$KVLEAGUE_PG_URL`` when set (CI may start its own server), else a
throwaway server started with ``scripts/postgres.sh`` on 127.0.0.1 (stopped at exit), else ``None``
when no PostgreSQL server binaries are installed (the only case in which PostgreSQL tests skip).
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

PG_URL_ENV = "KVLEAGUE_PG_URL"
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "postgres.sh"

_server_url: str | None = None
_server_dir: str | None = None


def postgres_binaries_present() -> bool:
    return bool(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or shutil.which("initdb") is not None


def postgres_server_url() -> str | None:
    """URL of a PostgreSQL server to test against (see module docstring)."""
    global _server_url, _server_dir
    env = os.environ.get(PG_URL_ENV)
    if env:
        return env
    if _server_url is not None:
        return _server_url
    if not postgres_binaries_present():
        return None
    _server_dir = tempfile.mkdtemp(prefix="kvlpg-")
    out = subprocess.run(["bash", str(SCRIPT), "start", _server_dir], capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/postgres.sh start failed: {out.stderr.strip()[-2000:]}")
    _server_url = out.stdout.strip().splitlines()[-1]
    atexit.register(stop_postgres_server)
    return _server_url


def stop_postgres_server() -> None:
    global _server_url, _server_dir
    if _server_dir is not None:
        subprocess.run(["bash", str(SCRIPT), "stop", _server_dir], capture_output=True, text=True, timeout=60)
    _server_url = _server_dir = None


def _admin_url(server_url: str) -> str:
    """The libpq URL of the server's maintenance database (for CREATE/DROP DATABASE)."""
    from sqlalchemy.engine import make_url

    url = make_url(server_url).set(drivername="postgresql", database="postgres")
    return url.render_as_string(hide_password=False)


def create_database(server_url: str) -> str:
    """A fresh, empty database on the server of ``server_url``; returns its SQLAlchemy URL."""
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    name = f"kvl_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_admin_url(server_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return (
        make_url(server_url).set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)
    )


def drop_database(url: str) -> None:
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    from kvleague.db.session import dispose_engines

    dispose_engines()  # close pooled connections before dropping
    name = make_url(url).database
    if name is None:
        return
    with psycopg.connect(_admin_url(url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
