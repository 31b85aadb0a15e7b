"""Writes and reads used by the sweep driver (the only writer) and by tests and dashboards.

Dimension rows are got-or-created by ``spec_hash``; sample results are inserted in batches with
``ON CONFLICT (cell_key) DO NOTHING`` (or, when re-running failed cells, ``DO UPDATE`` of rows whose
status is ``failed``), so a result that reaches the driver twice (a retried task whose first try
did finish) can never become two rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import Table, func, insert, select, update
from sqlalchemy.engine import Engine

from kvleague.db.models import (
    MEASURE_FIDELITY,
    STATUS_FAILED,
    STATUS_OK,
    Environment,
    GenerationSpec,
    MethodSpec,
    Model,
    ProtocolSpec,
    SampleResult,
    Sweep,
    TaskSpec,
)

SWEEPS = cast(Table, Sweep.__table__)
_CHUNK = 500  # keys per IN (...) query: well under SQLite's and PostgreSQL's parameter limits

RESULT_COLUMNS = tuple(c.name for c in SampleResult.__table__.columns if c.name not in ("id",))


def _dialect_insert(engine: Engine, table):
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table)
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(table)


def get_or_create(engine: Engine, model: type, values: dict[str, Any]) -> int:
    """Id of the row of ``model`` with ``values['spec_hash']``, inserting ``values`` if absent."""
    table = model.__table__
    with engine.begin() as conn:
        found = conn.execute(select(table.c.id).where(table.c.spec_hash == values["spec_hash"])).scalar()
        if found is not None:
            return int(found)
        stmt = _dialect_insert(engine, table).values(**values).on_conflict_do_nothing(index_elements=["spec_hash"])
        conn.execute(stmt)
        return int(conn.execute(select(table.c.id).where(table.c.spec_hash == values["spec_hash"])).scalar_one())


DIMENSIONS = {
    "model": Model,
    "method": MethodSpec,
    "task": TaskSpec,
    "protocol": ProtocolSpec,
    "generation": GenerationSpec,
    "environment": Environment,
}


def environment_id(engine: Engine, env: dict[str, Any]) -> int:
    values = {c.name: env[c.name] for c in Environment.__table__.columns if c.name in env}
    return get_or_create(engine, Environment, values)


def set_model_revision(engine: Engine, model_id: int, revision: str) -> None:
    """Record the Hub commit a model was loaded from (first report wins)."""
    table = cast(Table, Model.__table__)
    with engine.begin() as conn:
        conn.execute(
            update(table).where(table.c.id == model_id, table.c.revision.is_(None)).values(revision=revision[:255])
        )


def start_sweep(engine: Engine, values: dict[str, Any]) -> int:
    with engine.begin() as conn:
        return int(conn.execute(insert(SWEEPS).values(status="running", **values).returning(SWEEPS.c.id)).scalar_one())


def finish_sweep(engine: Engine, sweep_id: int, status: str, **counts: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(SWEEPS)
            .where(SWEEPS.c.id == sweep_id)
            .values(status=status, finished_at=datetime.now(timezone.utc), **counts)
        )


def existing_status(engine: Engine, keys: Iterable[str]) -> dict[str, str]:
    """``cell_key -> status`` for the keys that already have a row."""
    keys = list(keys)
    out: dict[str, str] = {}
    table = SampleResult.__table__
    with engine.connect() as conn:
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            for key, status in conn.execute(
                select(table.c.cell_key, table.c.status).where(table.c.cell_key.in_(chunk))
            ):
                out[key] = status
    return out


def write_results(engine: Engine, rows: Sequence[dict[str, Any]], replace_failed: bool = False) -> int:
    """Insert a batch in one transaction; a row whose cell key exists is skipped (or, with
    ``replace_failed``, replaces that row if it is a failed one). Returns the batch size."""
    if not rows:
        return 0
    table = SampleResult.__table__
    now = datetime.now(timezone.utc)
    clean = [
        {**{k: r.get(k) for k in RESULT_COLUMNS if k in r}, "created_at": r.get("created_at") or now} for r in rows
    ]
    stmt = _dialect_insert(engine, table)
    if replace_failed:
        stmt = stmt.on_conflict_do_update(
            index_elements=["cell_key"],
            set_={c: getattr(stmt.excluded, c) for c in RESULT_COLUMNS if c != "cell_key"},
            where=table.c.status == STATUS_FAILED,
        )
    else:
        stmt = stmt.on_conflict_do_nothing(index_elements=["cell_key"])
    groups: dict[tuple, list[dict]] = {}  # executemany needs one column set per statement
    for row in clean:
        groups.setdefault(tuple(sorted(row)), []).append(row)
    with engine.begin() as conn:
        for group in groups.values():
            conn.execute(stmt, group)
    return len(clean)


def count_results(engine: Engine, keys: Iterable[str] | None = None, status: str | None = None) -> int:
    table = SampleResult.__table__
    with engine.connect() as conn:
        if keys is None:
            q = select(func.count()).select_from(table)
            if status:
                q = q.where(table.c.status == status)
            return int(conn.execute(q).scalar_one())
        total = 0
        keys = list(keys)
        for i in range(0, len(keys), _CHUNK):
            q = select(func.count()).select_from(table).where(table.c.cell_key.in_(keys[i : i + _CHUNK]))
            if status:
                q = q.where(table.c.status == status)
            total += int(conn.execute(q).scalar_one())
        return total


def summary(engine: Engine, keys: Iterable[str]) -> list[dict[str, Any]]:
    """Per (model, task spec, method spec, budget, measure): cells, ok, failed, mean score over ok rows
    (generation) or mean KL and top-1 agreement over ok rows (fidelity). Task specs of one name (niah at
    two lengths) stay apart; ``task_options`` tells them apart."""
    r, m, t, ms = SampleResult.__table__, Model.__table__, TaskSpec.__table__, MethodSpec.__table__
    keys = list(keys)
    acc: dict[tuple, dict[str, Any]] = {}
    with engine.connect() as conn:
        tasks = {i: (name, options or {}) for i, name, options in conn.execute(select(t.c.id, t.c.name, t.c.options))}
        for i in range(0, len(keys), _CHUNK):
            q = (
                select(
                    m.c.name,
                    t.c.id,
                    ms.c.name,
                    ms.c.params_json,
                    r.c.budget,
                    r.c.measure,
                    r.c.status,
                    func.count(),
                    func.sum(r.c.score),
                    func.sum(r.c.kl_mean),
                    func.sum(r.c.top1_agreement),
                )
                .join(m, m.c.id == r.c.model_id)
                .join(t, t.c.id == r.c.task_id)
                .join(ms, ms.c.id == r.c.method_spec_id)
                .where(r.c.cell_key.in_(keys[i : i + _CHUNK]))
                .group_by(m.c.name, t.c.id, ms.c.name, ms.c.params_json, r.c.budget, r.c.measure, r.c.status)
            )
            for model, task_id, method, params, budget, measure, status, n, score_sum, kl_sum, top1_sum in conn.execute(
                q
            ):
                task, options = tasks[task_id]
                row = acc.setdefault(
                    (model, task, json.dumps(options, sort_keys=True, default=str), method, params, budget, measure),
                    {
                        "model": model,
                        "task": task,
                        "task_options": options,
                        "method": method,
                        "params": params,
                        "budget": budget,
                        "measure": measure,
                        "cells": 0,
                        "ok": 0,
                        "failed": 0,
                        "score_sum": 0.0,
                        "kl_sum": 0.0,
                        "top1_sum": 0.0,
                    },
                )
                row["cells"] += n
                if status == STATUS_OK:
                    row["ok"] += n
                    row["score_sum"] += float(score_sum or 0.0)
                    row["kl_sum"] += float(kl_sum or 0.0)
                    row["top1_sum"] += float(top1_sum or 0.0)
                else:
                    row["failed"] += n
    out = []
    for key in sorted(acc, key=lambda k: (str(k[0]), str(k[1]), k[2], str(k[3]), str(k[4]), int(k[5]), str(k[6]))):
        row = acc[key]
        sums = {name: row.pop(f"{name}_sum") for name in ("score", "kl", "top1")}
        fidelity = row["measure"] == MEASURE_FIDELITY
        row["mean_score"] = sums["score"] / row["ok"] if row["ok"] and not fidelity else None
        row["mean_kl"] = sums["kl"] / row["ok"] if row["ok"] and fidelity else None
        row["mean_top1"] = sums["top1"] / row["ok"] if row["ok"] and fidelity else None
        out.append(row)
    return out
