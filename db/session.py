"""Engine factory and schema upgrades.

* ``sqlite:///kvleague.db`` (the default, a file beside you) runs in WAL mode with foreign keys on
  and a busy timeout, so a dashboard can read while a sweep writes;
* ``postgresql+psycopg://user@host:port/db`` (psycopg 3); ``postgresql://`` and ``postgres://`` are
  taken to mean the same driver.

``upgrade(url)`` runs the Alembic migrations in ``db/migrations`` up to head (idempotent).
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from runner.errors import KvleagueError

DEFAULT_URL = "sqlite:///kvleague.db"
DB_URL_ENV = "KVLEAGUE_DB"
MIGRATIONS = Path(__file__).resolve().parent / "migrations"
ALLOWED = "sqlite:///PATH, sqlite:///:memory:, postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DB"


def default_url() -> str:
    return os.environ.get(DB_URL_ENV) or DEFAULT_URL


def parse_url(url: str, base_dir: str | Path | None = None) -> URL:
    """Validate a database URL; relative SQLite paths resolve against ``base_dir`` (default: cwd)."""
    if not isinstance(url, str) or not url.strip():
        raise KvleagueError(f"database: empty URL; allowed: {ALLOWED}")
    try:
        parsed = make_url(url.strip())
    except ArgumentError:
        raise KvleagueError(f"database: cannot parse {url!r}; allowed: {ALLOWED}") from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "postgres":
        backend = "postgresql"
    if backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise KvleagueError(f"database: unsupported SQLite driver {driver!r} in {url!r}; allowed: {ALLOWED}")
        db = parsed.database or ""
        if db and db != ":memory:" and not db.startswith("file:"):
            path = Path(db).expanduser()
            if not path.is_absolute():
                path = Path(base_dir or os.getcwd()) / path
            if not path.parent.is_dir():
                raise KvleagueError(f"database: directory {str(path.parent)!r} for the SQLite file does not exist")
            parsed = parsed.set(database=str(path))
        elif not db:
            raise KvleagueError(f"database: {url!r} names no SQLite file; allowed: {ALLOWED}")
        return parsed.set(drivername="sqlite")
    if backend == "postgresql":
        if driver not in ("", "psycopg"):
            raise KvleagueError(f"database: unsupported PostgreSQL driver {driver!r} in {url!r}; allowed: {ALLOWED}")
        if not parsed.database:
            raise KvleagueError(f"database: {url!r} names no database; allowed: {ALLOWED}")
        return parsed.set(drivername="postgresql+psycopg")
    raise KvleagueError(f"database: unsupported backend {parsed.drivername!r} in {url!r}; allowed: {ALLOWED}")


def display_url(url: URL | str) -> str:
    """The URL with any password hidden."""
    parsed = make_url(url) if isinstance(url, str) else url
    return parsed.render_as_string(hide_password=True)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


_ENGINES: dict[str, Engine] = {}


def _engine_for(url: str) -> Engine:
    engine = _ENGINES.get(url)
    if engine is not None:
        return engine
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(parsed, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(parsed, pool_pre_ping=True, connect_args={"connect_timeout": 10})
    _ENGINES[url] = engine
    return engine


def dispose_engines() -> None:
    """Close every pooled connection of the engines made here (tests drop databases after this)."""
    for engine in _ENGINES.values():
        engine.dispose()
    _ENGINES.clear()


def get_engine(url: str | None = None, base_dir: str | Path | None = None) -> Engine:
    """A (cached) engine for ``url`` (default ``$KVLEAGUE_DB`` or ``sqlite:///kvleague.db``)."""
    parsed = parse_url(url or default_url(), base_dir)
    return _engine_for(parsed.render_as_string(hide_password=False))


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def check_connection(engine: Engine) -> None:
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except (OperationalError, SQLAlchemyError) as exc:
        first = str(getattr(exc, "orig", exc) or exc).strip().splitlines()
        reason = first[0] if first else type(exc).__name__
        raise KvleagueError(f"database: cannot connect to {display_url(engine.url)}: {reason}") from None


def alembic_config(engine: Engine):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Migrate the schema to ``revision`` (default head); returns the revision now current."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    check_connection(engine)
    command.upgrade(alembic_config(engine), revision)
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(cfg).get_current_head()


def table_names(engine: Engine) -> list[str]:
    return sorted(inspect(engine).get_table_names())
