"""``kvleague bench --store``: a report's figures into the results database, and back.

Figures go to ``benchmark_results`` (one row per figure, see :class:`db.models.BenchmarkResult`),
linked to the ``environments`` row of the machine that measured them. Storing the same report
twice adds nothing (rows are unique on a hash of their content and run id).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any

from runner.bench.harness import validate_report


def _insert(engine, table):
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(table)


def row_key(report: dict[str, Any], fig: dict[str, Any]) -> str:
    body = [report["run_id"], report["benchmark"], fig["method"], fig["budget"], fig["metric"], fig["reference"], fig["details"]]
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def store_report(report: dict[str, Any], url: str | None = None) -> int:
    """Write every figure of ``report`` (migrating the schema first); returns how many are new."""
    from db import store
    from db.models import BenchmarkResult
    from db.session import get_engine, upgrade

    validate_report(report)
    engine = get_engine(url)
    upgrade(engine)
    env_id = store.environment_id(engine, report["environment"])
    config = report["config"]
    model = str(config.get("model_label") or config.get("model") or "")
    created = datetime.fromisoformat(report["created_at"])
    rows = [
        {"row_key": row_key(report, f), "run_id": report["run_id"], "benchmark": report["benchmark"], "environment_id": env_id,
         "model": model, "method": f["method"], "budget": f["budget"], "metric": f["metric"], "value": f["value"],
         "unit": f["unit"], "reference": f["reference"], "details": f["details"], "config": config, "created_at": created}
        for f in report["figures"]
    ]
    if not rows:
        return 0
    from sqlalchemy import func, select

    table = BenchmarkResult.__table__
    stmt = _insert(engine, table).on_conflict_do_nothing(index_elements=["row_key"])
    count = select(func.count()).select_from(table).where(table.c.run_id == report["run_id"])
    with engine.begin() as conn:
        before = conn.execute(count).scalar_one()
        conn.execute(stmt, rows)
        return int(conn.execute(count).scalar_one() - before)


def read_figures(url: str | None = None, *, run_id: str | None = None, benchmark: str | None = None) -> list[dict[str, Any]]:
    """Stored figures (oldest first), optionally of one run or one benchmark."""
    from sqlalchemy import select

    from db.models import BenchmarkResult
    from db.session import get_engine

    table = BenchmarkResult.__table__
    query = select(table).order_by(table.c.id)
    if run_id:
        query = query.where(table.c.run_id == run_id)
    if benchmark:
        query = query.where(table.c.benchmark == benchmark)
    with get_engine(url).connect() as conn:
        return [dict(row._mapping) for row in conn.execute(query)]
