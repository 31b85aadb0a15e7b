"""The results schema (SQLAlchemy 2.0 declarative models).

Dimension tables (``models``, ``method_specs``, ``tasks``, ``protocols``, ``generation_settings``,
``environments``) hold one row per distinct specification, keyed by ``spec_hash`` (a SHA-256 of the
canonical JSON of the specification), so every sweep that uses the same method with the same
hyperparameters points at the same row. ``sample_results`` holds one row per cell, unique on
``cell_key``; the leaderboard groups it by (model, task, protocol, method, budget).

The schema is created and upgraded only through the Alembic migrations in ``db/migrations``
(``kvleague db upgrade``); a test checks that the migrations and these models agree.
"""

from __future__ import annotations

from datetime import datetime, timezone
from types import UnionType
from typing import get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from kvleague.engine.protocol import Protocol

# Deterministic constraint names, so migrations are identical on SQLite and PostgreSQL.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: sample_results.status values
STATUS_OK = "ok"
STATUS_FAILED = "failed"
#: sample_results.measure values: a generation scored by the task, or teacher-forced fidelity to the full cache
MEASURE_GENERATION = "generation"
MEASURE_FIDELITY = "fidelity"


#: the escape character of free text: PostgreSQL refuses NUL in text, so NUL is stored as ESC + "0"
#: and ESC itself as ESC + ESC (U+FFFF, a noncharacter both databases store as is); text without either,
#: all text in practice, is stored unchanged
ESC = "\uffff"
_UNESCAPE = {ESC + ESC: ESC, ESC + "0": "\x00"}


def escape_text(value: str) -> str:
    if "\x00" not in value and ESC not in value:
        return value
    return value.replace(ESC, ESC + ESC).replace("\x00", ESC + "0")


def unescape_text(value: str) -> str:
    if ESC not in value:
        return value
    out, i = [], 0
    while (j := value.find(ESC, i)) >= 0:
        pair = value[j : j + 2]
        out += [value[i:j], _UNESCAPE.get(pair, pair)]
        i = j + len(pair)
    out.append(value[i:])
    return "".join(out)


class FreeText(TypeDecorator):
    """Text a model or a task file wrote (a completion, an error, a sample id): any character, NUL
    included, stored escaped (``escape_text``) the same way on SQLite and PostgreSQL and read back as
    written. Columns with a closed vocabulary or our own names are plain, and refuse NUL (db.validation)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return escape_text(value) if isinstance(value, str) else value

    def process_result_value(self, value, dialect):
        return unescape_text(value) if isinstance(value, str) else value


class FreeString(FreeText):
    """``FreeText`` of a bounded width (``FreeString(255)``; the width holds the escaped text)."""

    impl = String
    cache_ok = True


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Environment(Base):
    """Where code ran: the driver of a sweep, or a worker that produced results."""

    __tablename__ = "environments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(64), unique=True)
    hostname: Mapped[str] = mapped_column(String(255))
    platform: Mapped[str] = mapped_column(String(255))
    python_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    transformers_version: Mapped[str] = mapped_column(String(64))
    cuda_version: Mapped[str] = mapped_column(String(64))  # "none" on CPU-only builds
    gpu_name: Mapped[str] = mapped_column(String(255))  # "none" without a GPU
    gpu_count: Mapped[int] = mapped_column(Integer)
    kvleague_version: Mapped[str] = mapped_column(String(64))
    ray_version: Mapped[str] = mapped_column(String(64))
    git_commit: Mapped[str] = mapped_column(String(64))  # 40 hex digits, or "unknown"
    git_dirty: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Sweep(Base):
    """One invocation of the sweep runner (a resumed sweep is a new row with the same config hash)."""

    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), index=True)
    config: Mapped[dict] = mapped_column(JSON)
    config_hash: Mapped[str] = mapped_column(String(64), index=True)
    config_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    git_commit: Mapped[str] = mapped_column(String(64))
    git_dirty: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"))
    ray_address: Mapped[str | None] = mapped_column(String(255), nullable=True)
    ray_job_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    status: Mapped[str] = mapped_column(
        String(32)
    )  # running | finished | interrupted | stopped (a one-line error: disk full...) | crashed
    n_cells: Mapped[int] = mapped_column(Integer, default=0)
    n_skipped: Mapped[int] = mapped_column(Integer, default=0)  # already complete before this run
    n_ok: Mapped[int] = mapped_column(Integer, default=0)
    n_failed: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Model(Base):
    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(255), index=True)  # display label
    source: Mapped[str] = mapped_column(Text)  # HF id or local path, as written in the config
    revision: Mapped[str | None] = mapped_column(String(255), nullable=True)
    dtype: Mapped[str] = mapped_column(String(32))
    attn_implementation: Mapped[str] = mapped_column(String(64))


class MethodSpec(Base):
    __tablename__ = "method_specs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(255), index=True)
    params: Mapped[dict] = mapped_column(JSON)  # canonical: every hyperparameter, defaults filled in
    params_json: Mapped[str] = mapped_column(Text)  # the same, as sorted-key JSON (for display/grouping)


class TaskSpec(Base):
    __tablename__ = "tasks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(255), index=True)
    domain: Mapped[str] = mapped_column(String(32), index=True)
    options: Mapped[dict] = mapped_column(JSON)
    dataset: Mapped[str | None] = mapped_column(String(255), nullable=True)
    source: Mapped[str | None] = mapped_column(Text, nullable=True)  # Hub id or URL
    revision: Mapped[str | None] = mapped_column(String(255), nullable=True)
    scorer_version: Mapped[str] = mapped_column(String(64))
    metric: Mapped[str] = mapped_column(String(64))


#: the width of each text column of a protocol field (what the migrations created)
PROTOCOL_TEXT_WIDTHS = {"cadence": 64, "positions": 32, "prompt_over_budget": 16, "budget_base": 16, "scope": 16}


def protocol_columns() -> list[Column]:
    """One column per field of :class:`engine.protocol.Protocol`, in field order, typed from
    the field's type; NULL allowed where the field may be None, or is left out of the protocol's
    spec at its default (``Protocol.ADDED_LATER``: the row holds NULL then)."""
    columns = []
    for name, f in Protocol.model_fields.items():
        args = get_args(f.annotation)
        optional = isinstance(f.annotation, UnionType) and type(None) in args
        kind = next(a for a in args if a is not type(None)) if optional else f.annotation
        sql_type = {bool: Boolean, int: Integer, float: Float}.get(kind) or String(PROTOCOL_TEXT_WIDTHS[name])
        columns.append(Column(name, sql_type, nullable=optional or name in Protocol.ADDED_LATER))
    return columns


class ProtocolSpec(Base):
    """A protocol's row: its ``spec_hash`` (of ``Protocol.spec()``) and one column per field."""

    __table__ = Table(
        "protocols",
        Base.metadata,
        Column("id", Integer, primary_key=True),
        Column("spec_hash", String(64), unique=True, nullable=False),
        *protocol_columns(),
    )


class GenerationSpec(Base):
    __tablename__ = "generation_settings"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(64), unique=True)
    max_new_tokens: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float] = mapped_column(Float)
    top_p: Mapped[float] = mapped_column(Float)
    stop: Mapped[list] = mapped_column(JSON)


class SampleResult(Base):
    """One cell: (model, method spec, budget, task, sample, sample index, protocol, generation, seed),
    measured by generation (``correct``, ``score``, ...) or by teacher-forced fidelity to the full cache
    (``kl_mean``, ``delta_nll_mean``, ``top1_agreement``, ``scored_tokens``; ``runner/fidelity.py``). A
    fidelity row's generation settings are ``max_new_tokens`` = the cap on scored tokens, greedy, no stop
    strings: teacher forcing samples nothing."""

    __tablename__ = "sample_results"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cell_key: Mapped[str] = mapped_column(String(64), unique=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id"), index=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    method_spec_id: Mapped[int] = mapped_column(ForeignKey("method_specs.id"))
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"))
    protocol_id: Mapped[int] = mapped_column(ForeignKey("protocols.id"))
    generation_id: Mapped[int] = mapped_column(ForeignKey("generation_settings.id"))
    environment_id: Mapped[int | None] = mapped_column(ForeignKey("environments.id"), nullable=True)
    #: the budget as the sweep gave it: cache entries, or room on top of the prompt under a
    #: protocol with ``budget_base: prompt`` (then ``resolved_budget`` is the sample's own)
    budget: Mapped[int] = mapped_column(Integer)
    #: the cache budget the engine ran (NULL: rows before it, where it is ``budget``)
    resolved_budget: Mapped[int | None] = mapped_column(Integer, nullable=True)
    sample_id: Mapped[str] = mapped_column(FreeString(255))
    sample_index: Mapped[int] = mapped_column(Integer)  # 0..n_samples-1 (pass@k)
    seed: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # ok | failed
    measure: Mapped[str] = mapped_column(String(16), default=MEASURE_GENERATION, server_default=MEASURE_GENERATION)
    error: Mapped[str | None] = mapped_column(FreeText, nullable=True)
    correct: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)
    extracted: Mapped[str | None] = mapped_column(FreeText, nullable=True)
    completion: Mapped[str | None] = mapped_column(FreeText, nullable=True)
    stop_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    generated_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    prefill_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    decode_seconds_mean: Mapped[float | None] = mapped_column(Float, nullable=True)
    decode_seconds_p50: Mapped[float | None] = mapped_column(Float, nullable=True)
    decode_seconds_p95: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens_per_second: Mapped[float | None] = mapped_column(Float, nullable=True)
    method_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: the engine's share of method_seconds (protection, top-k, moving the cache entries)
    selection_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    wall_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    evictions: Mapped[int | None] = mapped_column(Integer, nullable=True)
    evicted_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: evictions in which the method's ranking decided (some candidate kept, some dropped)
    ranked_evictions: Mapped[int | None] = mapped_column(Integer, nullable=True)
    peak_cache_entries: Mapped[int | None] = mapped_column(Integer, nullable=True)
    peak_kv_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    peak_memory_source: Mapped[str | None] = mapped_column(String(64), nullable=True)
    attn_implementation: Mapped[str | None] = mapped_column(String(64), nullable=True)
    details: Mapped[dict | None] = mapped_column(
        JSON, nullable=True
    )  # scorer details, episode summary, fidelity extras
    #: fidelity: means over the scored tokens of KL(full || method) (nats), of -log q + log p of the
    #: reference token, and of [argmax p == argmax q]; and how many tokens were scored
    kl_mean: Mapped[float | None] = mapped_column(Float, nullable=True)
    delta_nll_mean: Mapped[float | None] = mapped_column(Float, nullable=True)
    top1_agreement: Mapped[float | None] = mapped_column(Float, nullable=True)
    scored_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)  # hostname:pid
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (
        # the leaderboard: one group per (model, task, protocol, method, budget), ok rows only
        Index(
            "ix_sample_results_leaderboard", "model_id", "task_id", "protocol_id", "method_spec_id", "budget", "status"
        ),
        Index("ix_sample_results_method_budget", "method_spec_id", "budget"),
        Index("ix_sample_results_task_budget", "task_id", "budget"),
        Index("ix_sample_results_status", "status"),
        Index("ix_sample_results_measure", "measure"),
    )


class BenchmarkResult(Base):
    """One figure of a systems benchmark run (``kvleague bench --store``): a number, its unit, and
    what it describes (method, budget, what a ratio is relative to). ``run_id`` groups the figures
    of one invocation; ``row_key`` (a hash of run, benchmark, method, budget, metric, reference and
    details) makes storing the same report twice a no-op."""

    __tablename__ = "benchmark_results"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    row_key: Mapped[str] = mapped_column(String(64), unique=True)
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    benchmark: Mapped[str] = mapped_column(String(64))  # one of runner/bench/harness.py BENCHMARKS
    environment_id: Mapped[int | None] = mapped_column(ForeignKey("environments.id"), nullable=True)
    model: Mapped[str] = mapped_column(Text)  # display label of the model measured
    method: Mapped[str | None] = mapped_column(String(255), nullable=True)
    budget: Mapped[int | None] = mapped_column(Integer, nullable=True)
    metric: Mapped[str] = mapped_column(String(64))
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    unit: Mapped[str] = mapped_column(String(32))
    reference: Mapped[str | None] = mapped_column(String(255), nullable=True)  # e.g. "full", "h2o", "generate"
    details: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    config: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # the run's settings (same for a run)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (Index("ix_benchmark_results_benchmark_metric", "benchmark", "metric"),)


class SignalCorrelation(Base):
    """One figure of a signal study (``kvleague signals``, issue 21): Spearman's rho between a per-token
    signal and an occlusion importance label, pooled over the run's samples, with a 95% bootstrap
    interval over samples. ``run_id`` groups one invocation; ``config`` holds its options (model, task
    and its options, samples, window, stride, trace, seeds...) and ``occluded`` where its windows slid;
    the environment row holds the git
    commit and library versions. ``row_key`` (a hash of run, label and signal) makes storing the same
    run twice a no-op."""

    __tablename__ = "signal_correlations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    row_key: Mapped[str] = mapped_column(String(64), unique=True)
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    environment_id: Mapped[int | None] = mapped_column(ForeignKey("environments.id"), nullable=True)
    model: Mapped[str] = mapped_column(Text)
    task: Mapped[str] = mapped_column(String(255))
    domain: Mapped[str] = mapped_column(String(32))
    label: Mapped[str] = mapped_column(String(32))  # occlusion_nll | answer_flip
    signal: Mapped[str] = mapped_column(String(255))  # e.g. hs_l2_diff_rolling64_l10, key_norm_mean, method:h2o
    family: Mapped[str] = mapped_column(String(64))  # the signal without its layer, or "method"
    layer: Mapped[int | None] = mapped_column(Integer, nullable=True)  # decoder layer of per-layer signals
    n_layers: Mapped[int] = mapped_column(Integer)
    rho: Mapped[float | None] = mapped_column(Float, nullable=True)  # None: a constant signal or label
    rho_lo: Mapped[float | None] = mapped_column(Float, nullable=True)
    rho_hi: Mapped[float | None] = mapped_column(Float, nullable=True)
    p_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    n_samples: Mapped[int] = mapped_column(Integer)
    n_pairs: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the rank partial correlation with `control` held fixed ("position"); None where not computed (migration 0007)
    control: Mapped[str | None] = mapped_column(String(32), nullable=True)
    partial_rho: Mapped[float | None] = mapped_column(Float, nullable=True)
    partial_lo: Mapped[float | None] = mapped_column(Float, nullable=True)
    partial_hi: Mapped[float | None] = mapped_column(Float, nullable=True)
    partial_p_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    # where the occlusion windows slid: "context" (before the answer, prompt included; every row before
    # migration 0009) or "trace" (the answer's trace only, the EpiKV authors' setting)
    occluded: Mapped[str] = mapped_column(String(16), default="context", server_default="context")

    __table_args__ = (Index("ix_signal_correlations_task_label", "task", "label"),)


TABLES = [t.name for t in Base.metadata.sorted_tables]

#: the sample_results columns that hold the engine's per-sample metrics: the fields of
#: ``GenerationResult`` that ``runner.metrics.METRIC_FIELDS`` keeps (a test holds the two equal; the
#: database cannot import the engine, which needs torch)
METRIC_COLUMNS = (
    "prompt_tokens",
    "generated_tokens",
    "attn_implementation",
    "prefill_seconds",
    "decode_seconds_mean",
    "decode_seconds_p50",
    "decode_seconds_p95",
    "tokens_per_second",
    "method_seconds",
    "selection_seconds",
    "evictions",
    "evicted_tokens",
    "ranked_evictions",
    "peak_cache_entries",
    "peak_kv_bytes",
    "peak_memory_bytes",
    "peak_memory_source",
)
#: the protocols columns that hold a protocol's fields (``protocol_columns``)
PROTOCOL_COLUMNS = tuple(c.name for c in ProtocolSpec.__table__.columns if c.name not in ("id", "spec_hash"))
