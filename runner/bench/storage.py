"""``kvleague bench --store``: a report's figures into the results database, and back.

Figures go to ``benchmark_results`` (one row per figure, see :class:`db.models.BenchmarkResult`),
linked to the ``environments`` row of the machine that measured them. Storing the same report
twice adds nothing (rows are unique on a hash of their content and run id).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kvleague.db.spec_hash import spec_hash
from kvleague.runner.bench.harness import validate_report


def _insert(engine, table):
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(table)


def row_key(report: dict[str, Any], fig: dict[str, Any]) -> str:
    body = [
        report["run_id"],
        report["benchmark"],
        fig["method"],
        fig["budget"],
        fig["metric"],
        fig["reference"],
        fig["details"],
    ]
    return spec_hash(body, spaced=True)


def check_storable(report: dict[str, Any]) -> None:
    """Raise ``ValueError`` (one line) unless every stored value of ``report`` fits its column: a
    report edited or damaged by hand is refused before anything is written, not by the database
    halfway through."""
    import math

    from sqlalchemy import Boolean, Float, Integer, String

    from kvleague.db.models import BenchmarkResult, Environment

    def check(where: str, column, value: Any) -> None:
        kind = column.type
        if value is None:
            if not column.nullable:
                raise ValueError(f"{where}: must not be null")
        elif isinstance(kind, Boolean):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: expected true or false")
        elif isinstance(kind, Integer):
            if not isinstance(value, int) or isinstance(value, bool) or not -(2**31) <= value < 2**31:
                raise ValueError(f"{where}: expected an integer from {-(2**31)} to {2**31 - 1}")
        elif isinstance(kind, Float):
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or abs(value) >= 2**63
                or not math.isfinite(value)
            ):
                raise ValueError(f"{where}: expected a finite number below 2**63 in size")
        elif isinstance(kind, String):
            if not isinstance(value, str) or (kind.length and len(value) > kind.length):
                raise ValueError(f"{where}: expected a string of at most {kind.length} characters")

    validate_report(report)
    env_columns = Environment.__table__.columns
    for key, value in report["environment"].items():
        if key in env_columns:
            check(f"environment.{key}", env_columns[key], value)
    figure_columns = BenchmarkResult.__table__.columns
    check("run_id", figure_columns["run_id"], report["run_id"])
    for i, fig in enumerate(report["figures"]):
        for key in ("method", "budget", "metric", "value", "unit", "reference"):
            check(f"figures[{i}].{key}", figure_columns[key], fig[key])
        if fig["budget"] is not None and fig["budget"] < 1:
            raise ValueError(f"figures[{i}].budget: must be positive, got {fig['budget']}")
    try:
        datetime.fromisoformat(report["created_at"])
    except ValueError:
        raise ValueError("created_at: expected an ISO 8601 date and time") from None


def store_report(report: dict[str, Any], url: str | None = None) -> int:
    """Write every figure of ``report`` (migrating the schema first); returns how many are new."""
    from kvleague.db import store
    from kvleague.db.models import BenchmarkResult
    from kvleague.db.session import get_engine, upgrade

    check_storable(report)
    engine = get_engine(url)
    upgrade(engine)
    env_id = store.environment_id(engine, report["environment"])
    config = report["config"]
    model = str(config.get("model_label") or config.get("model") or "")
    created = datetime.fromisoformat(report["created_at"])
    rows = [
        {
            "row_key": row_key(report, f),
            "run_id": report["run_id"],
            "benchmark": report["benchmark"],
            "environment_id": env_id,
            "model": model,
            "method": f["method"],
            "budget": f["budget"],
            "metric": f["metric"],
            "value": f["value"],
            "unit": f["unit"],
            "reference": f["reference"],
            "details": f["details"],
            "config": config,
            "created_at": created,
        }
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


def read_figures(
    url: str | None = None, *, run_id: str | None = None, benchmark: str | None = None
) -> list[dict[str, Any]]:
    """Stored figures (oldest first), optionally of one run or one benchmark."""
    from sqlalchemy import select

    from kvleague.db.models import BenchmarkResult
    from kvleague.db.session import get_engine

    table = BenchmarkResult.__table__
    query = select(table).order_by(table.c.id)
    if run_id:
        query = query.where(table.c.run_id == run_id)
    if benchmark:
        query = query.where(table.c.benchmark == benchmark)
    with get_engine(url).connect() as conn:
        return [dict(row._mapping) for row in conn.execute(query)]
