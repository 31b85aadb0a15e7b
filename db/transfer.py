"""Move a kvleague database between machines: ``export`` writes every table to one gzip file of JSON
lines; ``import_`` merges such a file into any database (SQLite or PostgreSQL) at the current schema.

The file: a header line ``{"format", "schema_revision", "columns": {table: [names]}}``, then one line
per row, ``[table, [values]]``, tables in foreign-key order and rows by id. Gzip's timestamp is zero
and rows are ordered, so the same database always gives the same bytes (a committed export diffs
cleanly and regenerates its report byte for byte).

Import merges rather than overwrites: a row whose natural key is already there (``spec_hash``,
``cell_key``, ``row_key``; for a sweep, its name, config hash and start time) is not inserted again, and ids and foreign keys
are renumbered to the target's, so importing the same file twice, or into a database with results of
its own, duplicates nothing.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, Table, insert, inspect, select
from sqlalchemy.engine import Engine

from kvleague.db.models import Base
from kvleague.db.session import current_revision, head_revision, known_revisions, upgrade
from kvleague.engine.errors import KvleagueError

FORMAT = "kvleague-export/1"
_CHUNK = 500


@dataclass
class TransferCounts:
    """Rows per table: written by an export; inserted and already present for an import."""

    written: dict[str, int] = field(default_factory=dict)
    inserted: dict[str, int] = field(default_factory=dict)
    present: dict[str, int] = field(default_factory=dict)


def _encode(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def _decode(column, value: Any) -> Any:
    if value is not None and isinstance(column.type, DateTime):
        return datetime.fromisoformat(value)
    return value


def export(engine: Engine, path: str | Path) -> TransferCounts:
    """Write every kvleague table of ``engine`` to ``path`` (.jsonl.gz), at the schema revision the
    database is at (any revision this code knows; ``import_`` migrates the target to head)."""
    revision = current_revision(engine)
    if revision not in known_revisions():
        raise KvleagueError(
            f"db export: the database has schema revision {revision or 'none'}, which this kvleague "
            f"does not know (head {head_revision()}); is it a kvleague database?"
        )
    inspector = inspect(engine)
    present = set(inspector.get_table_names())
    tables = [t for t in Base.metadata.sorted_tables if t.name in present]
    # an older schema lacks later columns: export those it has
    columns = {
        t.name: [c for c in t.columns if c.name in {d["name"] for d in inspector.get_columns(t.name)}] for t in tables
    }
    counts = TransferCounts()
    header = {
        "format": FORMAT,
        "schema_revision": revision,
        "columns": {t: [c.name for c in cs] for t, cs in columns.items()},
    }
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        gz.write((json.dumps(header, sort_keys=True) + "\n").encode())
        with engine.connect() as conn:
            for table in tables:
                n = 0
                for row in conn.execute(select(*columns[table.name]).order_by(*table.primary_key.columns)):
                    line = json.dumps([table.name, [_encode(v) for v in row]], sort_keys=True, ensure_ascii=False)
                    gz.write((line + "\n").encode())
                    n += 1
                counts.written[table.name] = n
    return counts


def _read(path: str | Path) -> tuple[dict[str, Any], Iterator[tuple[str, list[Any]]]]:
    """The export's header and its rows, the whole file read once first: a truncated or corrupt file is
    a one-line error before anything is written (or a database file is created)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            header = json.loads(fh.readline())
            if isinstance(header, dict) and header.get("format") == FORMAT:
                for number, line in enumerate(fh, start=2):
                    _row(path, number, line)
    except FileNotFoundError:
        raise KvleagueError(f"db import: no such file {str(path)!r}") from None
    except EOFError:
        raise KvleagueError(
            f"db import: {str(path)!r} is truncated (the gzip stream ends early); nothing was imported"
        ) from None
    except (OSError, ValueError) as exc:  # zlib.error is an OSError subclass in gzip; UnicodeDecodeError a ValueError
        raise KvleagueError(f"db import: {str(path)!r} is not a kvleague export (gzip JSON lines): {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise KvleagueError(f"db import: {str(path)!r} is not a kvleague export; expected format {FORMAT!r}")

    def rows() -> Iterator[tuple[str, list[Any]]]:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            fh.readline()
            for number, line in enumerate(fh, start=2):
                yield _row(path, number, line)

    return header, rows()


def _row(path: str | Path, number: int, line: str) -> tuple[str, list[Any]]:
    try:
        name, values = json.loads(line)
    except (ValueError, TypeError):
        raise KvleagueError(f"db import: {str(path)!r} line {number} is not [table, [values]]") from None
    return name, values


#: tables without a unique column: what identifies one of their rows (a sweep's counts and status
#: change while it runs, so an export taken mid-sweep and one taken after name the same sweep)
_IDENTITY = {"sweeps": ["name", "config_hash", "started_at"]}


def _natural_key(table: Table) -> list[str]:
    """The columns that identify a row across databases: its unique columns, else ``_IDENTITY``'s."""
    unique = [c.name for c in table.columns if c.unique]
    if unique:
        return unique
    if table.name not in _IDENTITY:
        raise KvleagueError(
            f"db import: table {table.name} has no identity for merging; add it to db.transfer._IDENTITY"
        )
    return _IDENTITY[table.name]


def _utc_naive(value: Any) -> Any:
    # SQLite gives naive UTC datetimes back, PostgreSQL aware ones: compare them as naive UTC
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


def _fingerprint(values: dict[str, Any]) -> str:
    return json.dumps({k: _encode(_utc_naive(v)) for k, v in values.items()}, sort_keys=True, default=str)


class _Merger:
    """Inserts one table's rows, renumbering ids and foreign keys, skipping rows already present."""

    def __init__(self, conn, table: Table, columns: list[str], id_maps: dict[str, dict[int, int]]):
        unknown = [c for c in columns if c not in table.columns]
        if unknown:
            raise KvleagueError(
                f"db import: table {table.name} has columns this kvleague does not know: {unknown}; "
                "import with the kvleague version that exported it"
            )
        self.conn, self.table, self.columns, self.id_maps = conn, table, columns, id_maps
        self.ids = id_maps.setdefault(table.name, {})
        self.key = _natural_key(table)
        self.foreign = {fk.parent.name: fk.column.table.name for fk in table.foreign_keys}
        self.referenced = any(fk.column.table is table for t in table.metadata.tables.values() for fk in t.foreign_keys)
        self.pending: list[tuple[int, dict[str, Any]]] = []
        self.inserted = self.present = 0

    def add(self, values: list[Any]) -> None:
        row = {name: _decode(self.table.columns[name], v) for name, v in zip(self.columns, values)}
        old_id = row.pop("id")
        for column, target in self.foreign.items():
            if row.get(column) is not None:
                try:
                    row[column] = self.id_maps[target][row[column]]
                except KeyError:
                    raise KvleagueError(
                        f"db import: {self.table.name} row {old_id} refers to a missing {target} row {row[column]}"
                    ) from None
        self.pending.append((old_id, row))
        if len(self.pending) >= _CHUNK:
            self.flush()

    def _existing(self, rows: list[dict[str, Any]]) -> dict[Any, int]:
        t = self.table
        if len(self.key) == 1:
            column = t.columns[self.key[0]]
            wanted = [r[column.name] for r in rows]
            found = self.conn.execute(select(column, t.c.id).where(column.in_(wanted))).all()
            return {value: ident for value, ident in found}
        # no unique column (sweeps): compare the identity columns in Python; such tables are small
        found = self.conn.execute(select(t)).mappings().all()
        return {_fingerprint({k: r[k] for k in self.key}): r["id"] for r in found}

    def _identity(self, row: dict[str, Any]) -> Any:
        return row[self.key[0]] if len(self.key) == 1 else _fingerprint({k: row.get(k) for k in self.key})

    def flush(self) -> None:
        if not self.pending:
            return
        existing = self._existing([r for _, r in self.pending])
        fresh: list[tuple[int, dict[str, Any]]] = []
        for old_id, row in self.pending:
            ident = existing.get(self._identity(row))
            if ident is None:
                fresh.append((old_id, row))
            else:
                self.ids[old_id] = ident
                self.present += 1
        if fresh and self.referenced:
            for old_id, row in fresh:  # ids are needed for the tables that refer to this one
                self.ids[old_id] = self.conn.execute(insert(self.table).values(**row)).inserted_primary_key[0]
        elif fresh:
            self.conn.execute(insert(self.table), [row for _, row in fresh])
        self.inserted += len(fresh)
        self.pending = []


def import_(engine: Engine, path: str | Path) -> TransferCounts:
    """Merge the export at ``path`` into ``engine`` (migrated to head first), in one transaction."""
    header, rows = _read(path)
    revision = header.get("schema_revision")
    if revision not in known_revisions():
        raise KvleagueError(
            f"db import: {str(path)!r} has schema revision {revision!r}, unknown to this kvleague "
            f"(head {head_revision()}); import it with the version that exported it"
        )
    upgrade(engine)
    tables = {t.name: t for t in Base.metadata.sorted_tables}
    columns = header.get("columns") or {}
    counts = TransferCounts()
    id_maps: dict[str, dict[int, int]] = {}
    with engine.begin() as conn:
        merger: _Merger | None = None

        def finish(m: _Merger | None) -> None:
            if m is not None:
                m.flush()
                name = m.table.name
                counts.inserted[name] = counts.inserted.get(name, 0) + m.inserted
                counts.present[name] = counts.present.get(name, 0) + m.present

        for name, values in rows:
            if merger is None or merger.table.name != name:
                finish(merger)
                if name not in tables or name not in columns:
                    raise KvleagueError(f"db import: unknown table {name!r}; allowed: {', '.join(tables)}")
                merger = _Merger(conn, tables[name], columns[name], id_maps)
            merger.add(values)
        finish(merger)
    return counts
