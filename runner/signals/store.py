"""A signal study's correlations into the results database (``signal_correlations``), with provenance:
the environment row (git commit, library versions, machine) and the run's options in ``config``. A row
also holds the partial rho with ``control`` (the position) held fixed, where the run computed one (NULL
in rows written before migration 0007 and for signals without it), and ``occluded``: where the run's
windows slid (``context`` or ``trace``, migration 0009)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

_LAYER = re.compile(r"^(?P<family>.+)_l(?P<layer>\d+)$")


def signal_family(signal: str) -> tuple[str, int | None]:
    """(family, layer) of a signal name: ``h2o_l3`` -> (h2o, 3), ``method:snapkv`` -> (method, None)."""
    if signal.startswith("method:"):
        return "method", None
    match = _LAYER.match(signal)
    return (match["family"], int(match["layer"])) if match else (signal, None)


def row_key(run_id: str, label: str, signal: str) -> str:
    return hashlib.sha256(json.dumps([run_id, label, signal]).encode()).hexdigest()


def _finite(value: float) -> float | None:
    return value if value == value and abs(value) != float("inf") else None


def store_correlations(report: dict[str, Any], url: str | None = None) -> int:
    """Write every correlation of ``report`` (migrating the schema first); returns how many are new."""
    from sqlalchemy import func, select

    from kvleague.db import store
    from kvleague.db.models import SignalCorrelation
    from kvleague.db.session import get_engine, upgrade

    engine = get_engine(url)
    upgrade(engine)
    env_id = store.environment_id(engine, report["environment"])
    config = report["config"]
    rows = []
    for c in report["correlations"]:
        family, layer = signal_family(c["signal"])
        rows.append(
            {
                "row_key": row_key(report["run_id"], c["label"], c["signal"]),
                "run_id": report["run_id"],
                "environment_id": env_id,
                "model": config["model"],
                "task": config["task"],
                "domain": config["domain"],
                "label": c["label"],
                "signal": c["signal"],
                "family": family,
                "layer": layer,
                "n_layers": config["n_layers"],
                "rho": _finite(c["rho"]),
                "rho_lo": _finite(c["lo"]),
                "rho_hi": _finite(c["hi"]),
                "p_value": _finite(c["p_value"]),
                "n_samples": c["n_samples"],
                "n_pairs": c["n_pairs"],
                "config": config,
                "control": c.get("control"),
                "partial_rho": _finite(c.get("partial_rho", float("nan"))),
                "partial_lo": _finite(c.get("partial_lo", float("nan"))),
                "partial_hi": _finite(c.get("partial_hi", float("nan"))),
                "partial_p_value": _finite(c.get("partial_p_value", float("nan"))),
                "occluded": config.get("options", {}).get("occluded", "context"),
            }
        )
    if not rows:
        return 0
    table = SignalCorrelation.__table__
    stmt = store._dialect_insert(engine, table).on_conflict_do_nothing(index_elements=["row_key"])
    count = select(func.count()).select_from(table).where(table.c.run_id == report["run_id"])
    with engine.begin() as conn:
        before = conn.execute(count).scalar_one()
        conn.execute(stmt, rows)
        return int(conn.execute(count).scalar_one() - before)
