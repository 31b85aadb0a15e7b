"""The single database writer: finished rows stream back from the workers to the driver, which writes
them in batches (workers need no database access).

Every write is idempotent (the database's unique ``cell_key`` holds one row per cell), so a driver
killed at any point, or two drivers on one sweep, leave exactly one row per finished cell. A lost
database (a server restarting) does not stop the sweep: rows wait in the buffer and the write is
retried with backoff, up to ``resources.db_retry_seconds``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kvleague.engine.errors import KvleagueError


def display(engine) -> str:
    """The database's URL, password masked."""
    from kvleague.db.session import display_url

    return display_url(engine.url)


def checked(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` validated against the schema (``db.validation``, as ``kvleague db import`` does); a row
    that may not be stored (a NaN score, a float too large...) becomes a failed row of its cell saying
    which field and why, so the sweep goes on and the cell can be re-run (``--retry-failed``)."""
    from kvleague.db.models import STATUS_FAILED
    from kvleague.db.validation import RowError, validate_row

    try:
        return validate_row("sample_results", row)
    except RowError as exc:
        reason = f"result not stored: {exc}"
        print(f"cell {row.get('cell_key')}: {reason}; recorded as failed", file=sys.stderr, flush=True)
        failed = {k: row[k] for k in IDENTITY if k in row}
        try:
            return validate_row("sample_results", {**failed, "status": STATUS_FAILED, "error": reason})
        except RowError as again:
            raise KvleagueError(f"cell {row.get('cell_key')}: cannot record it: {again}") from None


#: what names a cell's row (kept when its result cannot be stored)
IDENTITY = (
    "cell_key",
    "sweep_id",
    "model_id",
    "method_spec_id",
    "task_id",
    "protocol_id",
    "generation_id",
    "environment_id",
    "budget",
    "resolved_budget",
    "sample_id",
    "sample_index",
    "seed",
    "measure",
    "worker",
    "attempts",
)


class ResultWriter:
    """Buffers rows and writes them every ``batch_size`` rows or ``flush_seconds``."""

    def __init__(self, engine, resources, replace_failed: bool = False):
        self.engine, self.res, self.replace_failed = engine, resources, replace_failed
        self.buffer: list[dict[str, Any]] = []
        self.env_ids: dict[str, int] = {}
        self.revisions_known: set[int] = set()
        self.last_flush = time.monotonic()
        self.lost_since: float | None = None  # when a write first failed for a lost database
        self.retry_at, self.backoff = 0.0, 0.5

    def add(self, row: dict[str, Any]) -> None:
        self.buffer.append(row)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        """Workers' environments, model revisions, then the results: every step idempotent, so the
        whole is retried after a lost connection."""
        from kvleague.db import store

        engine, out = self.engine, []
        for row in rows:
            row = dict(row)
            env = row.pop("environment", None)
            revision = row.pop("model_revision", None)
            row = checked(row)
            if env is not None:
                if env["spec_hash"] not in self.env_ids:
                    self.env_ids[env["spec_hash"]] = store.environment_id(engine, env)
                row["environment_id"] = self.env_ids[env["spec_hash"]]
            if revision and row["model_id"] not in self.revisions_known:
                store.set_model_revision(engine, row["model_id"], str(revision))
                self.revisions_known.add(row["model_id"])
            out.append(row)
        store.write_results(engine, out, replace_failed=self.replace_failed)

    def _stop_on_storage(self, exc: BaseException, reason: str | None) -> None:
        """A disk that is full or a database that is read-only: waiting cures neither, so one line
        (the rows written so far stay; a re-run resumes after the rest)."""
        if reason is None:
            return
        lost = len(self.buffer)
        self.buffer.clear()  # said here; the forced flush on the way out must not try again
        raise KvleagueError(
            f"database: {display(self.engine)}: {reason}; {lost} finished results not written: "
            "make room (or make it writable), then run the same command again to resume"
        ) from None

    def flush(self, force: bool = False) -> None:
        """Write the buffer when due (``force``: now, waiting up to what is left of ``db_retry_seconds``)."""
        from sqlalchemy.exc import SQLAlchemyError

        from kvleague.db.session import error_reason, retrying, storage_fault, transient

        res, buffer = self.res, self.buffer
        now = time.monotonic()
        if (
            not buffer
            or not force
            and (now < self.retry_at or len(buffer) < res.batch_size and now - self.last_flush < res.flush_seconds)
        ):
            return
        if force:
            left = res.db_retry_seconds - (now - self.lost_since if self.lost_since is not None else 0.0)
            try:
                retrying(
                    self.engine, lambda: self._write(buffer), f"writing {len(buffer)} finished results", max(left, 1.0)
                )
            except KvleagueError as exc:
                raise KvleagueError(f"{exc}; run the same command again to resume") from None
            except SQLAlchemyError as exc:
                self._stop_on_storage(exc, storage_fault(exc))
                raise
        else:
            try:
                self._write(buffer)
            except SQLAlchemyError as exc:
                self._stop_on_storage(exc, storage_fault(exc))
                if not transient(exc):
                    raise
                self.lost_since = now if self.lost_since is None else self.lost_since
                if now - self.lost_since >= res.db_retry_seconds:
                    lost = len(buffer)
                    buffer.clear()  # said below; the forced flush on the way out must not wait again
                    raise KvleagueError(
                        f"database: {display(self.engine)} lost for {now - self.lost_since:.0f}s ({error_reason(exc)}); "
                        f"{lost} finished results not written: run the same command again to resume"
                    ) from None
                print(
                    f"database: cannot write {len(buffer)} finished results ({error_reason(exc)}); keeping them, "
                    f"retrying in {self.backoff:g}s",
                    file=sys.stderr,
                    flush=True,
                )
                self.retry_at, self.backoff = now + self.backoff, min(2 * self.backoff, 30.0)
                return
        if self.lost_since is not None:
            print(
                f"database: back after {time.monotonic() - self.lost_since:.0f}s; wrote {len(buffer)} results",
                file=sys.stderr,
                flush=True,
            )
        buffer.clear()
        self.last_flush, self.lost_since, self.retry_at, self.backoff = time.monotonic(), None, 0.0, 0.5
