"""Read-only SQL for the dashboard: every aggregation runs in the database (GROUP BY), and what comes
back is small - one row per problem cell, per-(method, budget) means, a few dimension rows.

The core building block is :func:`question_cells`: per method spec and budget, one row per problem
cell (a ``sample_id`` of a task under one model, protocol and generation setting) with ``k`` of its
``m`` samples correct, failed samples included (and counted as wrong), in a fixed order. Clustering
cells into questions, the common problem set and the statistics are decided in :mod:`analysis.tables`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from typing import cast as typed

from sqlalchemy import Integer, Table, and_, case, cast, create_engine, distinct, event, func, literal, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from kvleague.db.models import (
    MEASURE_FIDELITY,
    MEASURE_GENERATION,
    METRIC_COLUMNS,
    PROTOCOL_COLUMNS,
    STATUS_FAILED,
    STATUS_OK,
    BenchmarkResult,
    Environment,
    GenerationSpec,
    MethodSpec,
    Model,
    ProtocolSpec,
    SampleResult,
    Sweep,
    TaskSpec,
)
from kvleague.db.session import default_url
from kvleague.engine.errors import KvleagueError

R = typed(Table, SampleResult.__table__)
T = typed(Table, TaskSpec.__table__)
M = typed(Table, MethodSpec.__table__)
MO = typed(Table, Model.__table__)
P = typed(Table, ProtocolSpec.__table__)
G = typed(Table, GenerationSpec.__table__)
S = typed(Table, Sweep.__table__)
E = typed(Table, Environment.__table__)
B = typed(Table, BenchmarkResult.__table__)


FULL = "full"
DECODINGS = ("greedy", "sampled")


def resolve_url(cli: str | None = None) -> str:
    """``--db``, else ``$KVLEAGUE_DB``, else ``sqlite:///kvleague.db`` (the runner's convention)."""
    return cli or default_url()


# ------------------------------------------------------------------------------------------------
# Read-only engine
# ------------------------------------------------------------------------------------------------


def _sqlite_readonly(dbapi_connection, _record) -> None:
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA query_only=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def open_readonly(url: str) -> Engine:
    """An engine that cannot write: SQLite opened with ``mode=ro`` (and ``query_only``), PostgreSQL
    sessions with ``default_transaction_read_only``. A missing SQLite file is an error, not a new file."""
    from kvleague.db.session import display_url, parse_url

    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database or ""
        if db == ":memory:":
            raise KvleagueError("database: an in-memory SQLite database has no results to show; give a file")
        if db.startswith("file:"):
            raise KvleagueError(
                "database: give the SQLite file as sqlite:///PATH (the dashboard opens it read-only itself)"
            )
        path = Path(db)
        if not path.is_file():
            raise KvleagueError(
                f"database: no SQLite file at {str(path)!r}; run a sweep first (kvleague sweep --config ...)"
            )
        from urllib.parse import quote

        engine = create_engine(f"sqlite:///file:{quote(str(path))}?mode=ro&uri=true", connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_readonly)
    else:
        engine = create_engine(
            parsed,
            pool_pre_ping=True,
            connect_args={"connect_timeout": 10, "options": "-c default_transaction_read_only=on"},
        )
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except SQLAlchemyError as exc:
        first = str(getattr(exc, "orig", exc) or exc).strip().splitlines()
        raise KvleagueError(
            f"database: cannot open {display_url(parsed)}: {first[0] if first else type(exc).__name__}"
        ) from None
    return engine


def has_schema(engine: Engine, table: str = R.name) -> bool:
    from sqlalchemy import inspect

    return table in inspect(engine).get_table_names()


def fingerprint(engine: Engine) -> tuple[int, int]:
    """``(max id, row count)`` of sample_results: changes whenever results are added, replaced or removed."""
    with engine.connect() as conn:
        top, n = conn.execute(select(func.max(R.c.id), func.count()).select_from(R)).one()
    return (int(top or 0), int(n or 0))


def benchmark_fingerprint(engine: Engine) -> tuple[int, int]:
    """``(max id, row count)`` of benchmark_results (``(0, 0)`` on a schema from before that table)."""
    if not has_schema(engine, B.name):
        return (0, 0)
    with engine.connect() as conn:
        top, n = conn.execute(select(func.max(B.c.id), func.count()).select_from(B)).one()
    return (int(top or 0), int(n or 0))


# ------------------------------------------------------------------------------------------------
# Filters
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """``None`` means no restriction; an empty tuple selects nothing. ``measure``: which kind of row
    (generation: accuracy pages; fidelity: :mod:`analysis.fidelity_tables`; ``None``: both, for provenance)."""

    models: tuple[int, ...] | None = None
    domains: tuple[str, ...] | None = None
    tasks: tuple[int, ...] | None = None
    budgets: tuple[int, ...] | None = None
    protocols: tuple[int, ...] | None = None
    decoding: tuple[str, ...] | None = None
    measure: str | None = MEASURE_GENERATION
    #: generation-settings ids: set by a page's slice (:func:`slices`), not by a sidebar filter
    generations: tuple[int, ...] | None = None

    def conditions(self, budgets: bool = True) -> list:
        cond = []
        if self.measure is not None:
            cond.append(R.c.measure == self.measure)
        if self.models is not None:
            cond.append(R.c.model_id.in_(self.models))
        if self.tasks is not None:
            cond.append(R.c.task_id.in_(self.tasks))
        if self.domains is not None:
            cond.append(R.c.task_id.in_(select(T.c.id).where(T.c.domain.in_(self.domains)).scalar_subquery()))
        if self.protocols is not None:
            cond.append(R.c.protocol_id.in_(self.protocols))
        if self.generations is not None:
            cond.append(R.c.generation_id.in_(self.generations))
        if self.decoding is not None:
            kinds = set(self.decoding)
            if kinds == {"greedy"}:
                cond.append(R.c.generation_id.in_(select(G.c.id).where(G.c.temperature == 0).scalar_subquery()))
            elif kinds == {"sampled"}:
                cond.append(R.c.generation_id.in_(select(G.c.id).where(G.c.temperature > 0).scalar_subquery()))
            elif not kinds & set(DECODINGS):
                cond.append(literal(False))
        if budgets and self.budgets is not None:
            cond.append(R.c.budget.in_(self.budgets))
        return cond


# ------------------------------------------------------------------------------------------------
# Dimensions and filter options
# ------------------------------------------------------------------------------------------------


def _recent_part(row: dict[str, Any]) -> str:
    """``recent 16``, or ``recent min(128, B/4)`` where a fraction of the budget caps the window
    (``Protocol.recent_for``; B is the room under a relative budget)."""
    fraction = row.get("recent_max_fraction")
    if fraction is None:
        return f"recent {row['recent']}"
    share = f"B/{1 / fraction:g}" if (1 / fraction).is_integer() else f"{fraction:g}B"
    return f"recent min({row['recent']}, {share})"


#: how each field of a protocol row reads in its label, from the row (None: not shown, or shown in
#: another field's part); every protocol field (``PROTOCOL_COLUMNS``) needs an entry.
#: ``prompt_over_budget`` is not shown (the ``#id`` keeps two protocols apart).
PROTOCOL_LABEL_PARTS: dict[str, Callable[[dict[str, Any]], str | None] | None] = {
    "cadence": lambda r: str(r["cadence"]),
    "positions": lambda r: str(r["positions"]),
    "sink": lambda r: f"sink {r['sink']}",
    "recent": _recent_part,
    "protect_prompt": lambda r: "prompt protected" if r["protect_prompt"] else "prompt compressed",
    "prefill_chunk": lambda r: f"prefill chunk {r['prefill_chunk']}" if r.get("prefill_chunk") else None,
    "recent_max_fraction": None,  # in the recent window's part
    "prompt_over_budget": None,
    # NULL (rows before the field) and "none" are absolute budgets, which the labels never said
    "budget_base": lambda r: {"prompt": "budget = prompt + B", "ratio": "budget = compression ratio"}.get(
        r.get("budget_base") or ""
    ),
    # NULL (rows before the field) is "all", which the labels never said
    "scope": lambda r: "context compressed once (kvpress)" if r.get("scope") == "context" else None,
    "query_aware": lambda r: "query-aware" if r.get("query_aware") else None,
}


def budget_label(budget: int, budget_base: str | None, grouped: bool = False) -> str:
    """A budget as its protocol means it: ``192`` cache entries, ``prompt+64`` (room on top of each
    sample's prompt, ``budget_base: prompt``) or ``ratio 0.25`` (kvpress's compression ratio of the
    context, ``budget_base: ratio``, stored in thousandths); ``grouped``: thousands separated
    (``1,024``), as the dashboard writes numbers."""
    if budget_base == "ratio":
        return f"ratio {budget / 1000:g}"
    number = f"{budget:,}" if grouped else str(budget)
    return f"prompt+{number}" if budget_base == "prompt" else number


def protocol_label(row: dict[str, Any]) -> str:
    """``#id: every_step, absolute, sink 4, recent 16, prompt compressed``: the protocol's fields in order."""
    parts = [part(row) for name in PROTOCOL_COLUMNS if (part := PROTOCOL_LABEL_PARTS[name])]
    return f"#{row['id']}: " + ", ".join(p for p in parts if p)


def generation_label(row: dict[str, Any]) -> str:
    decoding = (
        "greedy" if float(row["temperature"]) == 0 else f"temperature {row['temperature']:g}, top-p {row['top_p']:g}"
    )
    return f"{decoding}, {row['max_new_tokens']} new tokens at most"


#: what a line across budgets must hold fixed: points of different models, protocols or generation
#: settings are different experiments, and a line joining them draws a budget effect that is not there
SLICE_COLUMNS = ("model", "protocol", "generation")


def slices(engine: Engine, filters: Filters) -> list[dict[str, Any]]:
    """The (model, protocol, generation setting) combinations the filters leave, each with its ``rows``
    (results of the filters' measure, failed ones included), ``methods`` and ``budgets`` and a
    ``label``; the one with the most rows first (ties: lowest ids)."""
    key = (R.c.model_id, R.c.protocol_id, R.c.generation_id)
    query = (
        select(*key, func.count(), func.count(distinct(R.c.method_spec_id)), func.count(distinct(R.c.budget)))
        .where(*filters.conditions())
        .group_by(*key)
    )
    with engine.connect() as conn:
        found = [tuple(int(v) for v in r) for r in conn.execute(query)]
        models = {r.id: r.name for r in conn.execute(select(MO.c.id, MO.c.name))}
        protocols = {r["id"]: protocol_label(r) for r in (dict(x._mapping) for x in conn.execute(select(P)))}
        generations = {r["id"]: generation_label(r) for r in (dict(x._mapping) for x in conn.execute(select(G)))}
    found.sort(key=lambda r: (-r[3], r[:3]))
    return [
        {
            "model_id": m,
            "protocol_id": p,
            "generation_id": g,
            "rows": n,
            "methods": k,
            "budgets": nb,
            "model": models[m],
            "protocol": protocols[p],
            "generation": f"#{g}: {generations[g]}",
            "label": f"{models[m]} · protocol {protocols[p]} · generation #{g}: {generations[g]}",
        }
        for m, p, g, n, k, nb in found
    ]


def in_slice(filters: Filters, chosen: dict[str, Any]) -> Filters:
    """The filters narrowed to one slice of :func:`slices`."""
    return replace(
        filters,
        models=(chosen["model_id"],),
        protocols=(chosen["protocol_id"],),
        generations=(chosen["generation_id"],),
    )


def identical_methods(engine: Engine, filters: Filters) -> list[tuple[int, ...]]:
    """Groups (two or more, ids ascending) of method specs whose results under the filters are the same
    on every sample: the same keys (budget, problem cell, sample index, seed) with the same status and
    completion, or for fidelity rows the same KL, top-1 agreement and ΔNLL. Their lines and rows
    coincide, so one would hide the other without a word."""
    fidelity = filters.measure == MEASURE_FIDELITY
    values = (R.c.kl_mean, R.c.top1_agreement, R.c.delta_nll_mean) if fidelity else (R.c.completion,)
    key = (
        R.c.budget,
        R.c.task_id,
        R.c.sample_id,
        R.c.model_id,
        R.c.protocol_id,
        R.c.generation_id,
        R.c.sample_index,
        R.c.seed,
    )
    query = select(R.c.method_spec_id, *key, R.c.status, *values).where(*filters.conditions())
    per_method: dict[int, set] = {}
    with engine.connect() as conn:
        for row in conn.execute(query):
            per_method.setdefault(int(row[0]), set()).add(tuple(row[1:]))
    groups: dict[frozenset, list[int]] = {}
    for method, results in per_method.items():
        groups.setdefault(frozenset(results), []).append(method)
    return sorted(tuple(sorted(g)) for g in groups.values() if len(g) > 1)


def _options(value: Any) -> dict[str, Any]:
    import json

    return json.loads(value) if isinstance(value, str) else dict(value or {})


def task_labels(tasks: Iterable[dict[str, Any]]) -> dict[int, str]:
    """``task_id -> label``: ``name (domain)``, plus the options that differ between tasks of that name,
    so that variants of one task (niah at several depths or sample counts) are told apart."""
    import json

    by_name: dict[str, list[dict[str, Any]]] = {}
    for t in tasks:
        by_name.setdefault(t["name"], []).append(t)
    out: dict[int, str] = {}
    for name, group in by_name.items():
        options = [_options(t.get("options")) for t in group]
        keys = sorted({k for o in options for k in o})
        differing = [k for k in keys if len({json.dumps(o.get(k), sort_keys=True) for o in options}) > 1]
        for t, o in zip(group, options):
            shown = ", ".join(f"{k}={o[k]}" for k in differing if k in o)  # an option a variant lacks: not shown
            out[t["id"]] = f"{name} ({t['domain']}{'; ' + shown if shown else ''})"
    return out


def row_counts(engine: Engine, filters: Filters, by: tuple[str, ...] = ("budget",)) -> dict[tuple, int]:
    """Result rows under the filters (the filters' measure, failed ones included) per value of the
    ``by`` columns of sample_results: what a page opens on is where most of the data is."""
    cols = [getattr(R.c, c) for c in by]
    query = select(*cols, func.count()).where(*filters.conditions()).group_by(*cols)
    with engine.connect() as conn:
        return {tuple(int(v) for v in r[:-1]): int(r[-1]) for r in conn.execute(query)}


def method_labels(specs: Iterable[dict[str, Any]]) -> dict[int, str]:
    """``method_spec_id -> label``: the name, plus the hyperparameters that differ between specs
    sharing that name (``h2o(heavy_ratio=0.25)``)."""
    import json

    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in specs:
        by_name.setdefault(s["name"], []).append(s)
    out: dict[int, str] = {}
    for name, group in by_name.items():
        if len(group) == 1:
            out[group[0]["id"]] = name
            continue
        params = [json.loads(g["params_json"]) if g.get("params_json") else dict(g.get("params") or {}) for g in group]
        keys = sorted({k for p in params for k in p})
        differing = [k for k in keys if len({json.dumps(p.get(k), sort_keys=True) for p in params}) > 1]
        for g, p in zip(group, params):
            shown = ", ".join(f"{k}={p.get(k)}" for k in differing)
            out[g["id"]] = f"{name}({shown})" if shown else f"{name}#{g['id']}"
    return out


@dataclass
class Options:
    models: list[dict[str, Any]] = field(default_factory=list)  # id, name
    tasks: list[dict[str, Any]] = field(default_factory=list)  # id, name, domain
    domains: list[str] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    #: budget -> how the results use it: ``64``, ``prompt+64`` or ``64 / prompt+64`` (one number, two meanings)
    budget_labels: dict[int, str] = field(default_factory=dict)
    protocols: list[dict[str, Any]] = field(default_factory=list)  # id, label, fields
    decodings: list[str] = field(default_factory=list)
    methods: dict[int, dict[str, Any]] = field(default_factory=dict)  # id -> name, params_json, label


def options(engine: Engine) -> Options:
    """What the filters can choose from: only dimension rows that have results."""
    out = Options()
    with engine.connect() as conn:
        used = lambda col: select(col).distinct().scalar_subquery()  # noqa: E731
        out.models = [
            dict(r._mapping)
            for r in conn.execute(
                select(MO.c.id, MO.c.name).where(MO.c.id.in_(used(R.c.model_id))).order_by(MO.c.name, MO.c.id)
            )
        ]
        out.tasks = [
            dict(r._mapping)
            for r in conn.execute(
                select(T.c.id, T.c.name, T.c.domain, T.c.options)
                .where(T.c.id.in_(used(R.c.task_id)))
                .order_by(T.c.domain, T.c.name, T.c.id)
            )
        ]
        labels = task_labels(out.tasks)
        out.tasks = [{**t, "label": labels[t["id"]]} for t in out.tasks]
        out.domains = sorted({t["domain"] for t in out.tasks})
        meanings: dict[int, list[str]] = {}  # every budget with results, in order, and what each means
        for b, base in conn.execute(
            select(R.c.budget, P.c.budget_base)
            .distinct()
            .join(P, P.c.id == R.c.protocol_id)
            .order_by(R.c.budget, P.c.budget_base.is_not(None), P.c.budget_base)
        ):
            meanings.setdefault(int(b), []).append(budget_label(int(b), base, grouped=True))
        out.budgets = list(meanings)
        out.budget_labels = {b: " / ".join(dict.fromkeys(labels)) for b, labels in meanings.items()}
        protos = [
            dict(r._mapping) for r in conn.execute(select(P).where(P.c.id.in_(used(R.c.protocol_id))).order_by(P.c.id))
        ]
        out.protocols = [{**p, "label": protocol_label(p)} for p in protos]
        temps = [
            float(t)
            for (t,) in conn.execute(select(G.c.temperature).distinct().where(G.c.id.in_(used(R.c.generation_id))))
        ]
        out.decodings = [d for d in DECODINGS if any((t == 0) == (d == "greedy") for t in temps)]
        specs = [
            dict(r._mapping)
            for r in conn.execute(
                select(M.c.id, M.c.name, M.c.params_json)
                .where(M.c.id.in_(used(R.c.method_spec_id)))
                .order_by(M.c.name, M.c.id)
            )
        ]
    labels = method_labels(specs)
    out.methods = {s["id"]: {**s, "label": labels[s["id"]]} for s in specs}
    return out


def dimensions(engine: Engine) -> dict[str, Any]:
    """Every method spec (with its display label) and task (with its domain and options: what a sample id of it
    holds, :mod:`analysis.identity`): small tables, read whole."""
    with engine.connect() as conn:
        specs = [
            dict(r._mapping) for r in conn.execute(select(M.c.id, M.c.name, M.c.params_json).order_by(M.c.name, M.c.id))
        ]
        tasks = [
            dict(r._mapping) for r in conn.execute(select(T.c.id, T.c.name, T.c.domain, T.c.options).order_by(T.c.id))
        ]
        models = [dict(r._mapping) for r in conn.execute(select(MO.c.id, MO.c.name).order_by(MO.c.id))]
    labels = method_labels(specs)
    return {
        "methods": {s["id"]: {**s, "label": labels[s["id"]]} for s in specs},
        "tasks": {t["id"]: t for t in tasks},
        "models": {m["id"]: m for m in models},
    }


# ------------------------------------------------------------------------------------------------
# Histograms
# ------------------------------------------------------------------------------------------------

_PROBLEM_KEY = ("model_id", "task_id", "protocol_id", "generation_id", "sample_id")


def _correct_int():
    return case((R.c.correct.is_(True), 1), else_=0)


def _int(expr):
    """SUM over integers is NUMERIC (Decimal) on PostgreSQL: keep every count a plain integer."""
    return cast(expr, Integer)


QUESTION_CELL_COLUMNS = (
    "method_spec_id",
    "budget",
    "task_id",
    "sample_id",
    "model_id",
    "protocol_id",
    "generation_id",
    "k",
    "m",
    "failed",
    "fired",
)


def question_cells(
    engine: Engine, filters: Filters, budgets: Iterable[int] | None = None, methods: Iterable[int] | None = None
) -> list[tuple]:
    """Tuples of :data:`QUESTION_CELL_COLUMNS`: one per (method spec, budget, problem cell) - tens of
    thousands of rows, so plain tuples - with ``k`` correct of ``m`` samples *including
    failed ones* (a failed sample counts as wrong), ``failed`` samples and ``fired`` (samples with
    evictions > 0), in a fixed order, so the statistics never depend on the database's row order.

    ``budgets``: restrict to these budgets (default: the filters' budgets)."""
    cond = [R.c.status.in_([STATUS_OK, STATUS_FAILED]), *filters.conditions(budgets=budgets is None)]
    if budgets is not None:
        cond.append(R.c.budget.in_(list(budgets)))
    if methods is not None:
        cond.append(R.c.method_spec_id.in_(list(methods)))
    key = [getattr(R.c, k) for k in QUESTION_CELL_COLUMNS[:7]]
    q = (
        select(
            *key,
            _int(func.sum(case((and_(R.c.status == STATUS_OK, R.c.correct.is_(True)), 1), else_=0))).label("k"),
            func.count().label("m"),
            _int(func.sum(case((R.c.status == STATUS_FAILED, 1), else_=0))).label("failed"),
            _int(func.sum(case((and_(R.c.status == STATUS_OK, R.c.evictions > 0), 1), else_=0))).label("fired"),
        )
        .where(and_(*cond))
        .group_by(*key)
        .order_by(*key)
    )
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(q).fetchall()]


FIDELITY_COLUMNS = (
    "method_spec_id",
    "budget",
    "task_id",
    "sample_id",
    "model_id",
    "protocol_id",
    "seed",
    "kl_mean",
    "top1_agreement",
    "delta_nll_mean",
    "scored_tokens",
    "evicted_tokens",
    "ranked_evictions",
    "prompt_tokens",
    "resolved_budget",
    "sweep_id",
)


def fidelity_rows(engine: Engine, filters: Filters, budgets: Iterable[int] | None = None) -> list[tuple]:
    """Tuples of :data:`FIDELITY_COLUMNS`: every ok fidelity row under the filters (one per method spec,
    budget, sample, model, protocol and seed), in a fixed order. ``budgets``: restrict to these
    (default: the filters' budgets)."""
    f = replace(filters, measure=MEASURE_FIDELITY)
    cond = [R.c.status == STATUS_OK, R.c.kl_mean.is_not(None), *f.conditions(budgets=budgets is None)]
    if budgets is not None:
        cond.append(R.c.budget.in_(list(budgets)))
    cols = [getattr(R.c, c) for c in FIDELITY_COLUMNS]
    q = select(*cols).where(and_(*cond)).order_by(*cols[:7])
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(q).fetchall()]


def method_budgets(engine: Engine, filters: Filters, method_ids: Iterable[int]) -> dict[int, int]:
    """``budget -> ok rows`` of the given method specs under the filters (budget filter ignored)."""
    ids = list(method_ids)
    if not ids:
        return {}
    q = (
        select(R.c.budget, func.count())
        .where(R.c.status == STATUS_OK, R.c.method_spec_id.in_(ids), *filters.conditions(budgets=False))
        .group_by(R.c.budget)
    )
    with engine.connect() as conn:
        return {int(b): int(n) for b, n in conn.execute(q)}


# ------------------------------------------------------------------------------------------------
# Cost
# ------------------------------------------------------------------------------------------------


def cost_rows(engine: Engine, filters: Filters, by_domain: bool = False) -> list[dict[str, Any]]:
    """Per (method spec, budget[, domain]): means of the timing and memory columns over ok rows, and the
    moments their intervals need (tokens/s squared; the method and model seconds' sums of products)."""
    decode_total = R.c.decode_seconds_mean * R.c.generated_tokens
    method_s = func.coalesce(R.c.method_seconds, 0)
    model_s = func.coalesce(R.c.prefill_seconds, 0) + func.coalesce(decode_total, 0)
    q = (
        select(
            R.c.method_spec_id,
            R.c.budget,
            *([T.c.domain] if by_domain else []),
            func.count().label("samples"),
            func.avg(R.c.tokens_per_second).label("tokens_per_second"),
            func.count(R.c.tokens_per_second).label("tokens_per_second_n"),
            func.avg(R.c.tokens_per_second * R.c.tokens_per_second).label("tokens_per_second_sq"),
            func.sum(method_s * method_s).label("method_seconds_sq_sum"),
            func.sum(method_s * model_s).label("method_model_seconds_sum"),
            func.sum(model_s * model_s).label("model_seconds_sq_sum"),
            func.avg(R.c.decode_seconds_mean).label("seconds_per_token"),
            func.avg(R.c.decode_seconds_p95).label("seconds_per_token_p95"),
            func.avg(R.c.prefill_seconds).label("prefill_seconds"),
            func.avg(R.c.generated_tokens).label("generated_tokens"),
            func.avg(R.c.peak_cache_entries).label("peak_cache_entries"),
            func.avg(R.c.peak_kv_bytes).label("peak_kv_bytes"),
            func.max(R.c.peak_kv_bytes).label("peak_kv_bytes_max"),
            func.avg(R.c.peak_memory_bytes).label("peak_memory_bytes"),
            func.max(R.c.peak_memory_bytes).label("peak_memory_bytes_max"),
            func.avg(R.c.method_seconds).label("method_seconds"),
            func.sum(R.c.method_seconds).label("method_seconds_sum"),
            func.avg(R.c.selection_seconds).label("selection_seconds"),
            func.sum(func.coalesce(R.c.prefill_seconds, 0) + func.coalesce(decode_total, 0)).label("model_seconds_sum"),
            func.avg(R.c.wall_seconds).label("wall_seconds"),
            _int(func.sum(_correct_int())).label("correct"),
        )
        .select_from(R.join(T, T.c.id == R.c.task_id))
        .where(R.c.status == STATUS_OK, *filters.conditions())
        .group_by(R.c.method_spec_id, R.c.budget, *([T.c.domain] if by_domain else []))
    )
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(q)]


def cost_setup(engine: Engine, filters: Filters) -> list[dict[str, Any]]:
    """What the slice's timings were taken under: per sweep, backend, cells decoded together, attention
    kernel and machine, the ok rows and distinct worker processes, with the sweep's resources."""
    backend = R.c.details["backend"].as_string()
    batch = R.c.details[("batch", "cells")].as_integer()
    q = (
        select(
            R.c.sweep_id,
            backend.label("backend"),
            batch.label("batch"),
            R.c.attn_implementation,
            E.c.hostname,
            E.c.platform,
            E.c.gpu_name,
            func.count().label("rows"),
            func.count(distinct(R.c.worker)).label("workers"),
        )
        .select_from(R.join(T, T.c.id == R.c.task_id).outerjoin(E, E.c.id == R.c.environment_id))
        .where(R.c.status == STATUS_OK, *filters.conditions())
        .group_by(R.c.sweep_id, backend, batch, R.c.attn_implementation, E.c.hostname, E.c.platform, E.c.gpu_name)
    )
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(q)]
        ids = sorted({r["sweep_id"] for r in rows})
        configs = dict(conn.execute(select(S.c.id, S.c.config).where(S.c.id.in_(ids))).all()) if ids else {}
    for r in rows:
        r["resources"] = (configs.get(r["sweep_id"]) or {}).get("resources") or {}
    return rows


def benchmark_rows(engine: Engine) -> list[dict[str, Any]]:
    """Every stored systems-benchmark figure (``kvleague bench ... --store``) with the machine that
    measured it; newest run first, a run's figures in the order its report lists them. ``[]`` on a
    schema from before the benchmark_results table."""
    if not has_schema(engine, B.name):
        return []
    q = (
        select(
            B.c.id,
            B.c.run_id,
            B.c.benchmark,
            B.c.model,
            B.c.method,
            B.c.budget,
            B.c.metric,
            B.c.value,
            B.c.unit,
            B.c.reference,
            B.c.details,
            B.c.config,
            B.c.created_at,
            E.c.hostname,
            E.c.platform,
            E.c.gpu_name,
            E.c.gpu_count,
            E.c.cuda_version,
        )
        .select_from(B.outerjoin(E, E.c.id == B.c.environment_id))
        .order_by(B.c.created_at.desc(), B.c.run_id, B.c.id)
    )
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(q)]


# ------------------------------------------------------------------------------------------------
# Samples
# ------------------------------------------------------------------------------------------------


def problem_ids(
    engine: Engine, filters: Filters, task_id: int, budget: int | None, disagree_only: bool = False, limit: int = 2000
) -> list[str]:
    """Sample ids of a task (at a budget); ``disagree_only``: where some method was right and another wrong."""
    cond = [R.c.task_id == task_id, R.c.status == STATUS_OK, *filters.conditions(budgets=False)]
    if budget is not None:
        cond.append(R.c.budget == budget)
    q = select(R.c.sample_id).where(*cond).group_by(R.c.sample_id)
    if disagree_only:
        q = q.having(func.min(_correct_int()) != func.max(_correct_int()))
    q = q.order_by(R.c.sample_id).limit(limit)
    with engine.connect() as conn:
        return [str(s) for (s,) in conn.execute(q)]


SAMPLE_COLUMNS = (
    "id",
    "method_spec_id",
    "model_id",
    "protocol_id",
    "generation_id",
    "sweep_id",
    "budget",
    "sample_index",
    "seed",
    "status",
    "error",
    "correct",
    "score",
    "extracted",
    "completion",
    "stop_reason",
    *METRIC_COLUMNS,
)


def sample_rows(
    engine: Engine, filters: Filters, task_id: int, sample_id: str, budget: int | None, limit: int = 500
) -> list[dict[str, Any]]:
    """Every stored generation of one problem (all methods) at a budget."""
    cond = [R.c.task_id == task_id, R.c.sample_id == sample_id, *filters.conditions(budgets=False)]
    if budget is not None:
        cond.append(R.c.budget == budget)
    q = (
        select(*[getattr(R.c, c) for c in SAMPLE_COLUMNS])
        .where(*cond)
        .order_by(R.c.method_spec_id, R.c.sample_index, R.c.seed, R.c.id)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(q)]


# ------------------------------------------------------------------------------------------------
# Provenance
# ------------------------------------------------------------------------------------------------


def provenance(
    engine: Engine, filters: Filters, method_ids: Iterable[int] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The sweeps, environments, seeds, protocols and generation settings behind the filtered rows."""
    cond = [*filters.conditions()]
    if method_ids is not None:
        cond.append(R.c.method_spec_id.in_(list(method_ids)))
    with engine.connect() as conn:
        per_sweep = {
            int(sid): (int(n), int(ok))
            for sid, n, ok in conn.execute(
                select(R.c.sweep_id, func.count(), _int(func.sum(case((R.c.status == STATUS_OK, 1), else_=0))))
                .where(*cond)
                .group_by(R.c.sweep_id)
            )
        }
        sweeps = []
        if per_sweep:
            q = (
                select(
                    S,
                    E.c.hostname,
                    E.c.platform,
                    E.c.python_version,
                    E.c.torch_version,
                    E.c.transformers_version,
                    E.c.cuda_version,
                    E.c.gpu_name,
                    E.c.gpu_count,
                    E.c.kvleague_version,
                    E.c.ray_version,
                )
                .select_from(S.outerjoin(E, E.c.id == S.c.environment_id))
                .where(S.c.id.in_(list(per_sweep)))
                .order_by(S.c.id)
            )
            for r in conn.execute(q):
                row = dict(r._mapping)
                row["rows"], row["ok_rows"] = per_sweep[row["id"]]
                sweeps.append(row)
        env_counts = {
            (int(e) if e is not None else None): int(n)
            for e, n in conn.execute(select(R.c.environment_id, func.count()).where(*cond).group_by(R.c.environment_id))
        }
        envs = []
        ids = [e for e in env_counts if e is not None]
        if ids:
            for r in conn.execute(select(E).where(E.c.id.in_(ids)).order_by(E.c.id)):
                row = dict(r._mapping)
                row["rows"] = env_counts[row["id"]]
                envs.append(row)
        seeds = [
            {"seed": int(s), "sample_indices": int(k), "rows": int(n)}
            for s, k, n in conn.execute(
                select(R.c.seed, func.count(distinct(R.c.sample_index)), func.count())
                .where(*cond)
                .group_by(R.c.seed)
                .order_by(R.c.seed)
            )
        ]
        proto_ids = [int(p) for (p,) in conn.execute(select(R.c.protocol_id).distinct().where(*cond))]
        protocols = (
            [dict(r._mapping) for r in conn.execute(select(P).where(P.c.id.in_(proto_ids)).order_by(P.c.id))]
            if proto_ids
            else []
        )
        gen_ids = [int(g) for (g,) in conn.execute(select(R.c.generation_id).distinct().where(*cond))]
        generations = (
            [dict(r._mapping) for r in conn.execute(select(G).where(G.c.id.in_(gen_ids)).order_by(G.c.id))]
            if gen_ids
            else []
        )
        model_ids = [int(m) for (m,) in conn.execute(select(R.c.model_id).distinct().where(*cond))]
        models = (
            [dict(r._mapping) for r in conn.execute(select(MO).where(MO.c.id.in_(model_ids)).order_by(MO.c.id))]
            if model_ids
            else []
        )
        task_ids = [int(t) for (t,) in conn.execute(select(R.c.task_id).distinct().where(*cond))]
        tasks = (
            [dict(r._mapping) for r in conn.execute(select(T).where(T.c.id.in_(task_ids)).order_by(T.c.id))]
            if task_ids
            else []
        )
    for p in protocols:
        p["label"] = protocol_label(p)
    return {
        "sweeps": sweeps,
        "environments": envs,
        "seeds": seeds,
        "protocols": protocols,
        "generations": generations,
        "models": models,
        "tasks": tasks,
    }
