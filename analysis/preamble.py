"""The counts a report's preamble states, computed from the database when the report is built, so the prose
about the data cannot drift from the data (:func:`resolve`, called by ``analysis.report.build``).

A placeholder is ``{{QUANTITY KEY=VALUE ... each=KEY}}``:

* QUANTITY, over the selected result rows: ``cells``; ``failed`` (cells whose status is not ok: may be 0);
  ``samples`` (distinct prompts, :func:`analysis.identity.prompt_key`, as the report's totals count them);
  ``methods`` (distinct method specs); ``budgets`` (the distinct budgets as the tables write them,
  ``48/96/192`` or ``prompt+64``); ``prompt_tokens`` (the mean prompt length, rounded); ``seconds`` (the
  median cell time, as the report's totals sum it, rounded). And ``signal_samples``: the samples of each
  selected signal study (``kvleague signals``).
* KEY=VALUE selects rows by a stored column; ``VALUE`` may list several, ``task=math500,niah``. Result rows:
  ``sweep`` (the name of the sweep that wrote the row), ``protocol`` (its id, the report's ``#4``),
  ``task`` (name), ``domain``, ``method`` (name), ``measure`` (``fidelity`` or ``generation``), ``budget``.
  Signal studies: ``task``, ``domain``, ``occluded`` (``context`` or ``trace``).
* ``each=KEY``: the quantity per value of KEY among the selected rows, written once where every value gives
  the same number and as ``lo-hi`` where they differ (``{{samples protocol=5 each=domain}}``: ``20-30``).

A placeholder that does not parse, names an unknown quantity or key, or whose selection matches no row is
an error naming the placeholder and what is allowed: a typo never prints 0.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import select

from kvleague.analysis import identity
from kvleague.analysis.queries import M as METHODS
from kvleague.analysis.queries import P, R, S, T, budget_label
from kvleague.db.models import STATUS_OK, SignalCorrelation
from kvleague.engine.errors import KvleagueError

PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}", re.S)
SC = SignalCorrelation.__table__

#: the selectors of result rows: key -> the column it reads
RESULT_KEYS = {
    "sweep": S.c.name,
    "protocol": R.c.protocol_id,
    "task": T.c.name,
    "domain": T.c.domain,
    "method": METHODS.c.name,
    "measure": R.c.measure,
    "budget": R.c.budget,
}
SIGNAL_KEYS = {"task": SC.c.task, "domain": SC.c.domain, "occluded": SC.c.occluded}
#: what the quantities read besides the keys
_RESULT_EXTRA = (
    R.c.status,
    R.c.task_id,
    R.c.sample_id,
    R.c.method_spec_id,
    R.c.prompt_tokens,
    R.c.wall_seconds,
    P.c.budget_base,
)
_SIGNAL_EXTRA = (SC.c.run_id, SC.c.n_samples)

Rows = list[dict[str, Any]]
Range = tuple[int, int]


def _count(rows: Rows, _tasks) -> Range:
    return len(rows), len(rows)


def _failed(rows: Rows, _tasks) -> Range:
    n = sum(r["status"] != STATUS_OK for r in rows)
    return n, n


def _samples(rows: Rows, tasks: Mapping[int, Any]) -> Range:
    n = len({identity.prompt_key({"id": r["task_id"], **tasks.get(r["task_id"], {})}, r["sample_id"]) for r in rows})
    return n, n


def _methods(rows: Rows, _tasks) -> Range:
    n = len({r["method_spec_id"] for r in rows})
    return n, n


def _prompt_tokens(rows: Rows, _tasks) -> Range:
    lengths = [r["prompt_tokens"] for r in rows if r["prompt_tokens"] is not None]
    if not lengths:
        raise ValueError("its rows store no prompt length")
    n = round(sum(lengths) / len(lengths))
    return n, n


def _seconds(rows: Rows, _tasks) -> Range:
    times = [r["wall_seconds"] for r in rows if r["wall_seconds"] is not None]
    if not times:
        raise ValueError("its rows store no cell time")
    n = round(statistics.median(times))
    return n, n


def _signal_samples(rows: Rows, _tasks) -> Range:
    per_run = [r["n_samples"] for r in rows]
    return min(per_run), max(per_run)


#: quantity -> (computes its range over rows, the table it reads)
QUANTITIES: dict[str, tuple[Callable[[Rows, Mapping[int, Any]], Range], str]] = {
    "cells": (_count, "results"),
    "failed": (_failed, "results"),
    "samples": (_samples, "results"),
    "methods": (_methods, "results"),
    "prompt_tokens": (_prompt_tokens, "results"),
    "seconds": (_seconds, "results"),
    "signal_samples": (_signal_samples, "signals"),
}
#: ``budgets`` writes labels, not a number
BUDGETS = "budgets"
_TABLE_KEYS = {"results": RESULT_KEYS, "signals": SIGNAL_KEYS}


def _read(engine, table: str) -> Rows:
    with engine.connect() as conn:
        if table == "signals":
            query = select(*(c.label(k) for k, c in SIGNAL_KEYS.items()), *_SIGNAL_EXTRA)
        else:
            query = (
                select(*(c.label(k) for k, c in RESULT_KEYS.items()), *_RESULT_EXTRA)
                .join(S, S.c.id == R.c.sweep_id)
                .join(T, T.c.id == R.c.task_id)
                .join(METHODS, METHODS.c.id == R.c.method_spec_id)
                .join(P, P.c.id == R.c.protocol_id)
            )
        return [dict(r._mapping) for r in conn.execute(query)]


def _render(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


class _Resolver:
    def __init__(self, engine, tasks: Mapping[int, Any]):
        self.engine, self.tasks = engine, tasks
        self.tables: dict[str, Rows] = {}

    def rows(self, table: str) -> Rows:
        if table not in self.tables:
            self.tables[table] = _read(self.engine, table)
        return self.tables[table]

    def __call__(self, match: re.Match) -> str:
        text = " ".join(match.group(0).split())

        def fail(why: str) -> KvleagueError:
            return KvleagueError(f"preamble: {text}: {why}")

        words = match.group(1).split()
        if not words or words[0] not in (*QUANTITIES, BUDGETS):
            raise fail(f"the quantity must be one of {', '.join([*QUANTITIES, BUDGETS])}")
        quantity, *pairs = words
        table = QUANTITIES[quantity][1] if quantity in QUANTITIES else "results"
        keys = _TABLE_KEYS[table]
        allowed = f"{quantity} takes {', '.join(keys)}, each"
        rows = self.rows(table)
        each: str | None = None
        chosen: dict[str, set[str]] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not value or key in chosen or (key == "each" and each is not None):
                raise fail(f"{pair!r}: write KEY=VALUE, each key once; {allowed}")
            if key == "each":
                if value not in keys:
                    raise fail(f"each={value}: unknown key; {allowed}")
                each = value
                continue
            if key not in keys:
                raise fail(f"unknown key {key!r}; {allowed}")
            present = {str(r[key]) for r in rows}
            values = set(value.split(","))
            if missing := sorted(values - present):
                raise fail(
                    f"{key}={missing[0]} matches no row; {key} is one of {', '.join(sorted(present)) or 'nothing'}"
                )
            chosen[key] = values
        picked = [r for r in rows if all(str(r[k]) in vs for k, vs in chosen.items())]
        if not picked:
            raise fail("matches no row (each selector matches some rows, not all of them together)")
        if quantity == BUDGETS:
            if each is not None:
                raise fail("each does not apply to budgets")
            found = sorted({(r["budget"], r["budget_base"] or "") for r in picked})
            return "/".join(dict.fromkeys(budget_label(b, base or None) for b, base in found))
        compute = QUANTITIES[quantity][0]
        groups: dict[str, Rows] = {}
        for r in picked:
            groups.setdefault(str(r[each]) if each else "", []).append(r)
        try:
            ranges = [compute(g, self.tasks) for g in groups.values()]
        except ValueError as exc:
            raise fail(str(exc)) from None
        return _render(min(lo for lo, _ in ranges), max(hi for _, hi in ranges))


def resolve(engine, text: str, tasks: Mapping[int, Any]) -> str:
    """``text`` with every placeholder replaced by its count in ``engine``'s results (module docstring);
    ``tasks``: the tasks table by id (``queries.dimensions``), for what a sample id holds."""
    return PLACEHOLDER.sub(_Resolver(engine, tasks), text)
