"""The per-sample metrics record: the fields of the engine's ``GenerationResult`` that a stored result
row keeps, derived from the dataclass so a figure the engine adds reaches the database (column
``db.models.METRIC_COLUMNS``, kept equal to :data:`METRIC_FIELDS` by a test) and the dashboard
without being copied by hand.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvleague.engine.generation import GenerationResult

#: ``GenerationResult`` fields that are not metrics: the cell's own spec (method, params, budget), the
#: completion and stop reason (stored as the row's own columns, from the sample's run), and what is
#: too large for a row (token ids, kept positions)
NOT_METRICS = ("completion", "token_ids", "stop_reason", "method", "params", "budget", "kept_positions")
METRIC_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GenerationResult) if f.name not in NOT_METRICS)


def metrics(generation: GenerationResult) -> dict[str, Any]:
    """The metric fields of one sample's ``GenerationResult``, by name."""
    return {name: getattr(generation, name) for name in METRIC_FIELDS}
