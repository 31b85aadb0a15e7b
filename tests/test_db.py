"""The results schema on SQLite and on a real PostgreSQL server: migrations, constraints, writes,
provenance."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect, select, text

from kvleague.db import store
from kvleague.db.models import Base, MethodSpec, SampleResult
from kvleague.db.session import get_engine, head_revision, upgrade

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def engine(db_url):
    eng = get_engine(db_url)
    upgrade(eng)
    return eng


def test_migrations_create_the_models_schema(engine):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    names = set(inspect(engine).get_table_names())
    assert {
        "sweeps",
        "environments",
        "models",
        "method_specs",
        "tasks",
        "protocols",
        "generation_settings",
        "sample_results",
        "alembic_version",
    } <= names
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == [], f"models and migrations disagree: {diff}"
    assert upgrade(engine) == head_revision()  # idempotent
    indexes = {ix["name"] for ix in inspect(engine).get_indexes("sample_results")}
    assert {
        "ix_sample_results_leaderboard",
        "ix_sample_results_method_budget",
        "ix_sample_results_task_budget",
    } <= indexes
    uniques = inspect(engine).get_unique_constraints("sample_results")
    assert any(u["column_names"] == ["cell_key"] for u in uniques)


def test_sqlite_runs_in_wal_mode(tmp_path):
    eng = get_engine(f"sqlite:///{tmp_path / 'wal.db'}")
    upgrade(eng)
    with eng.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1


def _dims(engine) -> dict[str, int]:
    from kvleague.runner.provenance import collect_environment

    ids = {
        "model_id": store.get_or_create(
            engine,
            store.DIMENSIONS["model"],
            {"spec_hash": "m" * 64, "name": "tiny", "source": "x/y", "dtype": "float32", "attn_implementation": "sdpa"},
        ),
        "method_spec_id": store.get_or_create(
            engine, MethodSpec, {"spec_hash": "a" * 64, "name": "knorm", "params": {}, "params_json": "{}"}
        ),
        "task_id": store.get_or_create(
            engine,
            store.DIMENSIONS["task"],
            {
                "spec_hash": "t" * 64,
                "name": "math500",
                "domain": "math",
                "options": {},
                "dataset": "MATH-500",
                "source": "hub/x",
                "revision": "abc",
                "scorer_version": "1",
                "metric": "accuracy",
            },
        ),
        "protocol_id": store.get_or_create(
            engine,
            store.DIMENSIONS["protocol"],
            {
                "spec_hash": "p" * 64,
                "cadence": "every_step",
                "positions": "absolute",
                "sink": 4,
                "recent": 8,
                "protect_prompt": True,
                "prefill_chunk": None,
            },
        ),
        "generation_id": store.get_or_create(
            engine,
            store.DIMENSIONS["generation"],
            {"spec_hash": "g" * 64, "max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "stop": []},
        ),
    }
    env_id = store.environment_id(engine, collect_environment())
    ids["sweep_id"] = store.start_sweep(
        engine,
        {
            "name": "t",
            "config": {"a": 1},
            "config_hash": "c" * 64,
            "git_commit": "unknown",
            "environment_id": env_id,
            "n_cells": 3,
        },
    )
    return ids


def _row(dims, key, status="ok", **extra):
    row = {
        **dims,
        "cell_key": key,
        "budget": 64,
        "sample_id": "s1",
        "sample_index": 0,
        "seed": 0,
        "status": status,
        "score": 1.0 if status == "ok" else None,
        "correct": status == "ok",
        "peak_kv_bytes": 2**40,
        "attempts": 1,
    }
    row.update(extra)
    return row


def test_one_row_per_cell_key(engine):
    dims = _dims(engine)
    assert (
        store.get_or_create(
            engine, MethodSpec, {"spec_hash": "a" * 64, "name": "knorm", "params": {}, "params_json": "{}"}
        )
        == dims["method_spec_id"]
    )
    store.write_results(engine, [_row(dims, "k1"), _row(dims, "k2", status="failed", error="RuntimeError: boom")])
    # the same cells again (a retried task whose first try also finished): nothing new
    store.write_results(engine, [_row(dims, "k1", score=0.0), _row(dims, "k2", status="failed", error="again")])
    assert store.count_results(engine) == 2
    assert store.existing_status(engine, ["k1", "k2", "k3"]) == {"k1": "ok", "k2": "failed"}
    with engine.connect() as conn:
        assert conn.execute(select(SampleResult.score).where(SampleResult.cell_key == "k1")).scalar() == 1.0
        assert conn.execute(select(SampleResult.peak_kv_bytes).where(SampleResult.cell_key == "k1")).scalar() == 2**40
    # re-running failed cells replaces failed rows only
    store.write_results(engine, [_row(dims, "k1", score=0.5), _row(dims, "k2", score=0.25)], replace_failed=True)
    assert store.count_results(engine) == 2
    with engine.connect() as conn:
        got = dict(conn.execute(select(SampleResult.cell_key, SampleResult.score)).all())
    assert got == {"k1": 1.0, "k2": 0.25}
    assert store.count_results(engine, status="failed") == 0
    rows = store.summary(engine, ["k1", "k2"])
    assert rows == [
        {
            "model": "tiny",
            "task": "math500",
            "task_options": {},
            "method": "knorm",
            "params": "{}",
            "budget": 64,
            "measure": "generation",
            "cells": 2,
            "ok": 2,
            "failed": 0,
            "mean_score": pytest.approx(0.625),
            "mean_kl": None,
            "mean_top1": None,
        }
    ]


def test_the_database_enforces_the_unique_cell_key(engine):
    from sqlalchemy import insert
    from sqlalchemy.exc import IntegrityError

    dims = _dims(engine)
    with engine.begin() as conn:
        conn.execute(insert(SampleResult.__table__).values(**_row(dims, "dup")))
    with pytest.raises(IntegrityError):
        with engine.begin() as conn:
            conn.execute(insert(SampleResult.__table__).values(**_row(dims, "dup")))


def test_provenance_has_real_values(engine, tmp_path):
    import torch
    import transformers

    from kvleague.runner.provenance import collect_environment, git_state

    env = collect_environment()
    assert env["python_version"] == sys.version.split()[0]
    assert env["torch_version"] == torch.__version__
    assert env["transformers_version"] == transformers.__version__
    assert env["hostname"] == socket.gethostname()
    assert env["cuda_version"] == (torch.version.cuda or "none")
    assert env["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert env["kvleague_version"] not in ("", "not installed")
    assert re.fullmatch(r"[0-9a-f]{40}", env["git_commit"]) or env["git_commit"] == "unknown"
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True
    )
    if head.returncode == 0:
        assert env["git_commit"] == head.stdout.strip()
    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    assert git_state(outside) == ("unknown", None)
    env_id = store.environment_id(engine, env)
    assert store.environment_id(engine, env) == env_id
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT python_version, torch_version, hostname, git_commit FROM environments WHERE id = :i"),
            {"i": env_id},
        ).one()
    assert tuple(row) == (env["python_version"], env["torch_version"], env["hostname"], env["git_commit"])


def test_db_upgrade_command(db_url, capsys):
    from kvleague.cli import main

    assert main(["db", "upgrade", "--db", db_url]) == 0
    assert "schema at revision" in capsys.readouterr().out
    assert main(["db", "status", "--db", db_url]) == 0
    assert "up to date" in capsys.readouterr().out


@pytest.mark.parametrize(
    "url, expected",
    [
        ("mysql://u@127.0.0.1/x", "unsupported backend 'mysql'"),
        ("not a url", "cannot parse"),
        ("postgresql+psycopg://u@127.0.0.1:1/x", "cannot connect to"),
    ],
)
def test_db_upgrade_bad_url_is_one_line(url, expected, capsys):
    from kvleague.cli import main

    assert main(["db", "upgrade", "--db", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_metric_and_protocol_columns_are_the_engines_fields():
    """One definition each: the stored per-sample metrics are GenerationResult's metric fields
    (runner.metrics), the protocols table's columns are Protocol's fields."""
    from kvleague.db.models import METRIC_COLUMNS, PROTOCOL_COLUMNS, ProtocolSpec
    from kvleague.engine.protocol import protocol_fields
    from kvleague.runner.metrics import METRIC_FIELDS

    assert sorted(METRIC_FIELDS) == sorted(METRIC_COLUMNS) and "selection_seconds" in METRIC_FIELDS
    assert set(METRIC_COLUMNS) <= set(SampleResult.__table__.columns.keys())
    assert PROTOCOL_COLUMNS == tuple(f.name for f in protocol_fields())
    assert set(ProtocolSpec.__table__.columns.keys()) == {"id", "spec_hash", *PROTOCOL_COLUMNS}
