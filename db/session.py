"""Engine factory and schema upgrades.

* ``sqlite:///kvleague.db`` (the default, a file beside you) runs in WAL mode with foreign keys on
  and a busy timeout, so a dashboard can read while a sweep writes;
* ``postgresql+psycopg://user@host:port/db`` (psycopg 3); ``postgresql://`` and ``postgres://`` are
  taken to mean the same driver.

``upgrade(url)`` runs the Alembic migrations in ``db/migrations`` up to head (idempotent).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kvleague.engine.errors import KvleagueError

T = TypeVar("T")

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
    # Python's sqlite3 opens a transaction only before INSERT/UPDATE/DELETE, so CREATE TABLE would
    # commit at once: a driver killed mid-migration would leave tables without their revision. We
    # begin every transaction ourselves (below), DDL included.
    dbapi_connection.isolation_level = None


def _sqlite_begin(conn) -> None:
    conn.exec_driver_sql("BEGIN")


_ENGINES: dict[str, Engine] = {}


def _engine_for(url: str) -> Engine:
    engine = _ENGINES.get(url)
    if engine is not None:
        return engine
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(parsed, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
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
    except SQLAlchemyError as exc:
        raise KvleagueError(f"database: cannot connect to {display_url(engine.url)}: {error_reason(exc)}") from None


def alembic_config(engine: Engine):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Migrate the schema to ``revision`` (default head); returns the revision now current. Drivers
    started together on a new database take turns (a lock), so neither sees half-made tables."""
    from alembic import command

    check_connection(engine)
    if revision == "head" and current_revision(engine) == head_revision():
        return head_revision()
    with _migration_lock(engine):
        command.upgrade(alembic_config(engine), revision)
    return current_revision(engine)


_PG_MIGRATION_LOCK = 0x6B766C67  # any constant key for pg_advisory_lock, the same in every driver


@contextlib.contextmanager
def _migration_lock(engine: Engine):
    """PostgreSQL: a session advisory lock; SQLite: ``flock`` on the file's directory (not on the
    file: closing another descriptor of it would drop SQLite's own locks)."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_lock({_PG_MIGRATION_LOCK})")
            try:
                yield
            finally:
                conn.exec_driver_sql(f"SELECT pg_advisory_unlock({_PG_MIGRATION_LOCK})")
        return
    db = engine.url.database or ""
    if not db or db == ":memory:" or db.startswith("file:"):
        yield
        return
    import fcntl

    fd = os.open(str(Path(db).parent), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def transient(exc: BaseException) -> bool:
    """A database error that waiting can cure: a lost or refused connection (a server restarting),
    a SQLite file locked by another writer. Anything else (a constraint, a missing table) is not."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    import sqlite3

    if isinstance(exc.orig, sqlite3.Error):
        text = str(exc.orig).lower()
        return "locked" in text or "busy" in text
    return True


#: PostgreSQL's SQLSTATEs of a store that cannot take writes, and SQLite's messages for the same
_PG_STORAGE = {
    "53100": "the disk is full",
    "25006": "the database is read-only",
    "53200": "the server is out of memory",
}
_SQLITE_STORAGE = {
    "database or disk is full": "the disk is full (or the database reached its size limit)",
    "attempt to write a readonly database": "the database is read-only",
    "unable to open database file": "cannot open the database file (is it, or its directory, read-only or missing?)",
    "disk i/o error": "disk I/O error",
}


def storage_fault(exc: BaseException) -> str | None:
    """Why a database cannot store or be opened (disk full, read-only, unopenable), in a few words;
    None for any other error. Waiting does not cure these: the caller stops with one line."""
    import sqlite3

    orig = getattr(exc, "orig", None) or exc
    if isinstance(orig, sqlite3.Error):
        text = str(orig).lower()
        return next((reason for key, reason in _SQLITE_STORAGE.items() if key in text), None)
    return _PG_STORAGE.get(getattr(orig, "sqlstate", None) or "")


def error_reason(exc: BaseException) -> str:
    """The first line of a database error, without SQLAlchemy's statement and background link."""
    first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return first[0] if first else type(exc).__name__


def retrying(engine: Engine, fn: Callable[[], T], what: str, seconds: float) -> T:
    """``fn()`` (one idempotent transaction), retried with backoff while the database error is
    transient; after ``seconds`` one line: which database, what could not be done, why."""
    deadline = time.monotonic() + seconds
    delay = 0.5
    while True:
        try:
            return fn()
        except SQLAlchemyError as exc:
            if not transient(exc):
                raise
            if time.monotonic() + delay > deadline:
                raise KvleagueError(
                    f"database: {what} failed for {seconds:g}s at {display_url(engine.url)}: {error_reason(exc)}"
                ) from None
            print(f"database: {what}: {error_reason(exc)}; retrying in {delay:g}s", file=sys.stderr, flush=True)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _scripts():
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(cfg)


def head_revision() -> str:
    head = _scripts().get_current_head()
    assert head is not None  # the package ships its migrations
    return head


def known_revisions() -> set[str]:
    """Every schema revision this code can migrate from."""
    return {script.revision for script in _scripts().walk_revisions()}


def table_names(engine: Engine) -> list[str]:
    return sorted(inspect(engine).get_table_names())
