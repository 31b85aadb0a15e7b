"""Move a kvleague database between machines: ``export`` writes every table to one gzip file of JSON
lines; ``import_`` merges such a file into any database (SQLite or PostgreSQL) at the current schema.

The file: a header line ``{"format", "schema_revision", "columns": {table: [names]}}``, then one line
per row, ``[table, [values]]``, tables in foreign-key order and rows by id. Gzip's timestamp is zero
and rows are ordered, so the same database always gives the same bytes (a committed export diffs
cleanly and regenerates its report byte for byte).

Import validates the whole file first (``db.validation``: every value against its column, ids and unique
keys unique within the file, foreign keys naming earlier rows, lines at most ``MAX_LINE_BYTES``), so a
refused file is one line naming the line and the field, and writes nothing. Import merges rather than overwrites: a row whose natural key is already there (``spec_hash``,
``cell_key``, ``row_key``; for a sweep, its name, config hash and start time) is not inserted again, and ids and foreign keys
are renumbered to the target's, so importing the same file twice, or into a database with results of
its own, duplicates nothing.
"""

from __future__ import annotations

import gzip
import hashlib
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
from kvleague.db.validation import MAX_LINE_BYTES, RowError, validate_row
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


class _Hashing:
    """The raw file as gzip reads it, hashed: the second pass (the inserts) must read the bytes the first
    (the validation) read."""

    def __init__(self, raw):
        self.raw, self.digest = raw, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.digest.update(data)
        return data


def _lines(path: str | Path, digests: list[str]) -> Iterator[tuple[int, str]]:
    """``(number, line)`` of the decompressed file, streamed: a line longer than ``MAX_LINE_BYTES`` is
    refused after reading that much (memory stays bounded whatever the file expands to); at the end the
    file's digest is appended to ``digests``."""
    with open(path, "rb") as raw:
        hashing = _Hashing(raw)
        with gzip.GzipFile(fileobj=hashing, mode="rb") as gz:  # type: ignore[arg-type]
            number = 0
            while line := gz.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    raise KvleagueError(
                        f"db import: {str(path)!r} line {number} is longer than {MAX_LINE_BYTES} bytes; nothing was imported"
                    )
                yield number, line.decode("utf-8")
        digests.append(hashing.digest.hexdigest())


def _header(path: str | Path, line: str) -> dict[str, Any]:
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise KvleagueError(f"db import: {str(path)!r} is not a kvleague export; expected format {FORMAT!r}")
    columns = header.get("columns")
    tables = {t.name: t for t in Base.metadata.sorted_tables}
    if not isinstance(columns, dict):
        raise KvleagueError(f"db import: {str(path)!r} line 1: columns: not a table -> [column names] mapping")
    for name, names in columns.items():
        if name not in tables:
            raise KvleagueError(
                f"db import: {str(path)!r} line 1: unknown table {name!r}; allowed: {', '.join(tables)}"
            )
        if not isinstance(names, list) or "id" not in names or len(set(names)) != len(names):
            raise KvleagueError(
                f"db import: {str(path)!r} line 1: columns of {name}: not a list of distinct names with id"
            )
        unknown = [c for c in names if c not in tables[name].columns]
        if unknown:
            raise KvleagueError(
                f"db import: {str(path)!r} line 1: table {name} has columns this kvleague does not know: {unknown}; "
                "import with the kvleague version that exported it"
            )
    return header


def _row(path: str | Path, number: int, line: str) -> tuple[str, list[Any]]:
    try:
        name, values = json.loads(line)
    except (ValueError, TypeError, RecursionError):
        raise KvleagueError(f"db import: {str(path)!r} line {number} is not [table, [values]]") from None
    if not isinstance(name, str) or not isinstance(values, list):
        raise KvleagueError(f"db import: {str(path)!r} line {number} is not [table, [values]]")
    return name, values


def _opened(path: str | Path, lines: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """``lines`` with the file's faults as one-line errors."""
    try:
        yield from lines
    except FileNotFoundError:
        raise KvleagueError(f"db import: no such file {str(path)!r}") from None
    except EOFError:
        raise KvleagueError(
            f"db import: {str(path)!r} is truncated (the gzip stream ends early); nothing was imported"
        ) from None
    except (OSError, ValueError) as exc:  # zlib.error is an OSError subclass in gzip; UnicodeDecodeError a ValueError
        raise KvleagueError(f"db import: {str(path)!r} is not a kvleague export (gzip JSON lines): {exc}") from None


def _check(path: str | Path) -> tuple[dict[str, Any], str]:
    """Validate the whole export before anything is written (or a database file created): every row
    against its table's schema (``db.validation``), ids and unique keys unique within the file, foreign
    keys naming rows before them. Returns the header and the file's digest; a fault is one line naming
    the line and the field."""
    digests: list[str] = []
    header: dict[str, Any] = {}
    tables = {t.name: t for t in Base.metadata.sorted_tables}
    ids: dict[str, set[int]] = {}
    unique: dict[str, dict[Any, int]] = {}
    for number, line in _opened(path, _lines(path, digests)):
        if number == 1:
            header = _header(path, line)
            continue
        name, values = _row(path, number, line)
        where = f"db import: {str(path)!r} line {number}"
        names = header["columns"].get(name)
        if names is None:
            raise KvleagueError(
                f"{where}: table {name!r} is not in the header; allowed: {', '.join(header['columns'])}"
            )
        if len(values) != len(names):
            raise KvleagueError(f"{where}: {name} row has {len(values)} values for {len(names)} columns")
        try:
            row = validate_row(name, dict(zip(names, values)))
        except RowError as exc:
            raise KvleagueError(f"{where}: {exc}; nothing was imported") from None
        table = tables[name]
        if row.get("id") is None:
            raise KvleagueError(f"{where}: {name}.id: missing (an export numbers every row)")
        for column in [c for c in table.columns if c.primary_key or c.unique]:
            value = row.get(column.name)
            seen = unique.setdefault(f"{name}.{column.name}", {})
            if value in seen:
                raise KvleagueError(
                    f"{where}: {name}.{column.name}: {value!r} again (first on line {seen[value]}); nothing was imported"
                )
            seen[value] = number
        for fk in table.foreign_keys:
            value = row.get(fk.parent.name)
            if value is not None and value not in ids.get(fk.column.table.name, ()):
                raise KvleagueError(
                    f"{where}: {name}.{fk.parent.name}: no {fk.column.table.name} row {value} before it; "
                    "nothing was imported"
                )
        ids.setdefault(name, set()).add(row["id"])
    if not header:
        raise KvleagueError(f"db import: {str(path)!r} is empty; not a kvleague export")
    return header, digests[0]


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
    """Merge the export at ``path`` into ``engine`` (migrated to head first), in one transaction, after
    the whole file is validated (``_check``): a refused file writes nothing and creates no file."""
    header, digest = _check(path)
    revision = header.get("schema_revision")
    if revision not in known_revisions():
        raise KvleagueError(
            f"db import: {str(path)!r} has schema revision {revision!r}, unknown to this kvleague "
            f"(head {head_revision()}); import it with the version that exported it"
        )
    upgrade(engine)
    tables = {t.name: t for t in Base.metadata.sorted_tables}
    columns = header["columns"]
    counts = TransferCounts()
    id_maps: dict[str, dict[int, int]] = {}
    digests: list[str] = []
    with engine.begin() as conn:
        merger: _Merger | None = None

        def finish(m: _Merger | None) -> None:
            if m is not None:
                m.flush()
                name = m.table.name
                counts.inserted[name] = counts.inserted.get(name, 0) + m.inserted
                counts.present[name] = counts.present.get(name, 0) + m.present

        for number, line in _opened(path, _lines(path, digests)):
            if number == 1:
                continue
            name, values = _row(path, number, line)
            if merger is None or merger.table.name != name:
                finish(merger)
                merger = _Merger(conn, tables[name], columns[name], id_maps)
            merger.add(values)
        finish(merger)
        if digests != [digest]:  # rolls the transaction back
            raise KvleagueError(f"db import: {str(path)!r} changed while it was imported; nothing was imported")
    return counts
