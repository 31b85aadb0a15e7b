"""Hostile input (issue 20): generated mutations of a sweep YAML and of a ``kvleague score`` JSONL
file (wrong types, missing and extra fields, huge numbers, negative budgets, unicode, deep nesting,
enormous values, truncated files, bytes that are not UTF-8). Each must end as the user sees it: exit
code 2 and one line on stderr, no traceback, no row written. And the dashboard's engine cannot write.

The generators are seeded (``random.Random``), so a failure names a mutant that reproduces."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from kvleague import cli
from kvleague.engine.errors import KvleagueError
from kvleague.runner.sweep_config import INT32

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("KVLEAGUE_DATA_DIR") or REPO.parent / "shared" / "data")
N_MUTANTS = 240
MAX_LINE = 1500  # an error line stays readable (allowed values listed, the input cut short), whatever the input held

DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
UNICODE = ["☃", "名前", "é\u0301", "\u202e", "😀", "\x00", "a\nb"]
REQUIRED = {(): ["name", "models", "methods", "budgets", "tasks"]}
#: integer fields with an upper bound (the others are unbounded on purpose, e.g. a sample limit)
BOUNDED_INTS = [
    ("budgets", 0),
    ("seeds", 0),
    ("generation", "n_samples"),
    ("generation", "max_new_tokens"),
    ("protocol", "sink"),
    ("protocol", "recent"),
    ("resources", "workers"),
    ("resources", "max_restarts"),
    ("resources", "max_task_retries"),
    ("resources", "max_cell_attempts"),
    ("resources", "batch_size"),
    ("resources", "in_flight_per_worker"),
    ("tasks", 0, "max_new_tokens"),
]
NON_NEGATIVE = BOUNDED_INTS + [
    ("tasks", 0, "limit"),
    ("generation", "temperature"),
    ("resources", "cpus_per_worker"),
    ("resources", "flush_seconds"),
    ("resources", "cell_timeout_seconds"),
    ("resources", "memory_limit_gb"),
    ("resources", "db_retry_seconds"),
]
NAMED = [
    ("name",),
    ("methods", 0),
    ("methods", 1, "name"),
    ("tasks", 0, "name"),
    ("models", 0, "dtype"),
    ("protocol", "cadence"),
    ("protocol", "positions"),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from kvleague.runner.models.tiny import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("fuzz") / "tiny-llama", seed=0)


def base_config(model: Path, db: Path) -> dict:
    # ``models`` last: a file cut anywhere loses at least the end of the model's path
    return {
        "name": "fuzz",
        "database": f"sqlite:///{db}",
        "methods": ["full", {"name": "streaming_llm", "params": {"n_sink": 2}}],
        "budgets": [32, 64],
        "tasks": [{"name": "kv_agent", "limit": 1, "max_new_tokens": 2}],
        "protocol": {"sink": 2, "recent": 4, "protect_prompt": False},
        "generation": {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "n_samples": 1},
        "seeds": [0],
        "resources": {
            "workers": 1,
            "cpus_per_worker": 1,
            "batch_size": 4,
            "flush_seconds": 1.0,
            "cell_timeout_seconds": 60.0,
            "memory_limit_gb": 4.0,
            "db_retry_seconds": 5.0,
            "max_restarts": 1,
            "max_task_retries": 1,
            "max_cell_attempts": 2,
            "in_flight_per_worker": 1,
        },
        "models": [{"dtype": "float32", "source": str(model)}],
    }


def _get(node, path):
    for p in path:
        node = node[p]
    return node


def _set(cfg: dict, path: tuple, value) -> dict:
    cfg = copy.deepcopy(cfg)
    _get(cfg, path[:-1])[path[-1]] = value
    return cfg


def _nested(depth: int):
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


def mutate(rng: random.Random, cfg: dict) -> tuple[str, str | bytes]:
    """One mutant: ``(what was done, file content)``; every kind is invalid by construction."""
    kind = rng.choice(
        [
            "wrong_type",
            "missing",
            "extra",
            "negative",
            "huge",
            "unicode",
            "nested",
            "enormous",
            "truncated",
            "not_utf8",
            "not_a_mapping",
            "unset_env",
            "non_finite",
        ]
    )
    dump = lambda c: yaml.dump(c, Dumper=DUMPER, sort_keys=False, allow_unicode=True)  # noqa: E731
    if kind == "wrong_type":
        path = rng.choice(
            [
                ("budgets",),
                ("seeds",),
                ("tasks",),
                ("protocol",),
                ("generation",),
                ("resources",),
                *NON_NEGATIVE,
                ("protocol", "protect_prompt"),
                ("models", 0),
                ("methods", 1, "params"),
            ]
        )
        current = _get(cfg, path)
        bad = (
            [["x"], {"a": 1}]
            if not isinstance(current, (dict, list))
            else [7, "word"]
            if isinstance(current, dict)
            else [{"a": 1}, 7]
        )
        if isinstance(current, (int, float)) and not isinstance(current, bool):
            bad += ["seven", "1e2x", [1, 2]]
        if path == ("models", 0):
            bad = [{"path": 1}, 7, []]
        value = rng.choice(bad)
        return f"{kind} {path}={value!r}", dump(_set(cfg, path, value))
    if kind == "missing":
        path = rng.choice(
            [
                ("name",),
                ("models",),
                ("methods",),
                ("budgets",),
                ("tasks",),
                ("methods", 1, "name"),
                ("tasks", 0, "name"),
            ]
        )
        out = copy.deepcopy(cfg)
        del _get(out, path[:-1])[path[-1]]
        return f"{kind} {path}", dump(out)
    if kind == "extra":
        holders = [
            (),
            ("protocol",),
            ("generation",),
            ("resources",),
            ("tasks", 0),
            ("methods", 1),
            ("methods", 1, "params"),
            ("tasks", 0, "options"),
        ]
        path = rng.choice(holders)
        out = copy.deepcopy(cfg)
        out["tasks"][0]["options"] = {}
        field = rng.choice(["extra", "budget", "timeout", "ключ", "😀", "__class__"])
        _get(out, path)[field] = rng.choice([1, "x", None, [1], {"a": 1}])
        return f"{kind} {path}.{field}", dump(out)
    if kind == "negative":
        path = rng.choice(NON_NEGATIVE)
        value = rng.choice([-1, -(2**40), -0.5])
        return f"{kind} {path}={value}", dump(_set(cfg, path, value))
    if kind == "huge":
        path = rng.choice(BOUNDED_INTS)
        value = rng.choice([INT32 + 1, 2**63, 10**40, 10**400])
        return f"{kind} {path}={value}", dump(_set(cfg, path, value))
    if kind == "unicode":
        path = rng.choice(NAMED)
        value = rng.choice(UNICODE) + rng.choice(["", "full", "kv_agent"])
        return f"{kind} {path}={value!r}", dump(_set(cfg, path, value))
    if kind == "nested":
        path = rng.choice(
            [("name",), ("budgets",), ("models", 0), ("methods", 1), ("protocol",), ("tasks", 0, "limit")]
        )
        depth = rng.choice([5, 60, 3000, 50000])
        if depth > 100:  # deeper than the YAML emitter goes: write the flow sequence by hand
            body = dump(_set(cfg, path, "NESTED"))
            return f"{kind} {path} depth {depth}", body.replace("NESTED", "[" * depth + "x" + "]" * depth, 1)
        return f"{kind} {path} depth {depth}", dump(_set(cfg, path, _nested(depth)))
    if kind == "enormous":
        path = rng.choice(NAMED + [("methods", 1, "params", "n_sink"), ("database",)])
        value = rng.choice(["A" * 3_000_000, "☃" * 500_000, "sqlite:///" + "d/" * 200_000])
        return f"{kind} {path} ({len(value)} characters)", dump(_set(cfg, path, value))
    if kind == "truncated":
        body = dump(cfg)
        cut = rng.randrange(0, len(body) - 2)  # the model path's last character and newline always go
        return f"{kind} at {cut}/{len(body)}", body[:cut]
    if kind == "not_utf8":
        body = dump(cfg).encode()
        at = rng.randrange(0, len(body))
        return f"{kind} at {at}", body[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"]) + body[
            at:
        ]
    if kind == "not_a_mapping":
        return kind, rng.choice(["- a\n- b\n", "42\n", "just words\n", "null\n", "", "[]\n", "'quoted'\n"])
    if kind == "unset_env":
        path = rng.choice([("name",), ("database",), ("models", 0), ("tasks", 0, "name")])
        return f"{kind} {path}", dump(_set(cfg, path, "${KVLEAGUE_FUZZ_UNSET_VARIABLE}"))
    path = rng.choice(
        [
            ("generation", "temperature"),
            ("generation", "top_p"),
            ("resources", "flush_seconds"),
            ("resources", "cpus_per_worker"),
            ("budgets", 0),
            ("resources", "cell_timeout_seconds"),
        ]
    )
    return f"{kind} {path}", dump(_set(cfg, path, "NONFINITE")).replace(
        "NONFINITE", rng.choice([".inf", "-.inf", ".nan"]), 1
    )


def _run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_fuzzed_sweep_configs(tiny_llama, tmp_path, capsys, monkeypatch):
    """240 mutants of a valid sweep YAML through `kvleague sweep --config`: each one line, exit 2, no
    traceback, and no database file (so no row). Ray is disabled: a mutant that validated would
    reach it, and fail the test with a different message."""
    from kvleague.runner.sweeping.scheduler import Scheduler

    def no_ray(self):
        raise KvleagueError("ray: not in this test (a mutant was accepted)")

    monkeypatch.setattr(Scheduler, "init_ray", no_ray)
    db = tmp_path / "fuzz.db"
    cfg = base_config(tiny_llama, db)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, out, err = _run_cli(capsys, ["sweep", "--config", str(path), "--dry-run"])
    assert rc == 0 and "cells (dry run; nothing written)" in out, err  # the base config is valid
    rng = random.Random(20)
    kinds: dict[str, int] = {}
    for i in range(N_MUTANTS):
        what, body = mutate(rng, cfg)
        (path.write_bytes if isinstance(body, bytes) else path.write_text)(body)
        rc, out, err = _run_cli(capsys, ["sweep", "--config", str(path), "--no-progress"])
        lines = err.splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("kvleague: error: "), (i, what, rc, err[-2000:])
        assert "Traceback" not in err and "not in this test" not in err and len(lines[0]) <= MAX_LINE, (
            i,
            what,
            err[:2000],
        )
        assert not db.exists(), (i, what)
        kinds[what.split()[0]] = kinds.get(what.split()[0], 0) + 1
    assert len(kinds) == 13, kinds  # every kind of mutation was generated
    print(f"fuzzed configs: {N_MUTANTS}, all exit 2 with one line; by kind: {kinds}")


def test_config_errors_name_the_field_and_the_allowed_values(tiny_llama, tmp_path, capsys):
    cfg = base_config(tiny_llama, tmp_path / "x.db")
    path = tmp_path / "sweep.yaml"
    cases = [
        (_set(cfg, ("budgets", 0), INT32 + 1), f"budgets: must be at most {INT32}, got {INT32 + 1}"),
        (_set(cfg, ("seeds", 0), 2**63), f"seeds: must be at most {INT32}, got {2**63}"),
        (
            _set(cfg, ("resources", "cell_timeout_seconds"), 0),
            "resources.cell_timeout_seconds: Input should be greater than 0",
        ),
        (
            _set(cfg, ("resources", "memory_limit_gb"), "lots"),
            "resources.memory_limit_gb: Input should be a valid number",
        ),
        (_set(cfg, ("resources", "timeout"), 5), "resources.timeout: unknown field; allowed: workers, cpus_per_worker"),
        (_set(cfg, ("name",), "x" * 5000), "name: String should have at most 200 characters (got 'xxxx"),
    ]
    for data, expected in cases:
        path.write_text(yaml.safe_dump(data))
        rc, _, err = _run_cli(capsys, ["sweep", "--config", str(path), "--dry-run"])
        assert rc == 2 and err.startswith(f"kvleague: error: config {path}: {expected}"), err[:500]
        assert len(err) < MAX_LINE
    path.write_text("tasks: " + "[" * 50000 + "]" * 50000 + "\n")
    rc, _, err = _run_cli(capsys, ["sweep", "--config", str(path)])
    assert (rc, err) == (
        2,
        f"kvleague: error: config {path}: invalid YAML at line 1, column 1007: exceeded maximum nesting depth\n",
    )
    path.write_bytes(b"name: caf\xe9\n")
    rc, _, err = _run_cli(capsys, ["sweep", "--config", str(path)])
    assert (rc, err) == (2, f"kvleague: error: config {path}: not UTF-8 text (byte 9)\n")


# ------------------------------------------------------------------------------------------------
# kvleague score: JSONL completions
# ------------------------------------------------------------------------------------------------


def _aime_ids() -> list[str]:
    from kvleague.tasks.registry import build_task

    return [s.sample_id for s in build_task("aime25", {}).load(data_dir=str(DATA_DIR))]


def mutate_jsonl(rng: random.Random, rows: list[dict]) -> tuple[str, bytes]:
    kind = rng.choice(
        [
            "wrong_type",
            "missing",
            "extra",
            "huge",
            "unicode_id",
            "nested",
            "enormous",
            "truncated",
            "not_utf8",
            "not_an_object",
            "not_json",
            "empty",
            "non_finite",
        ]
    )
    rows = copy.deepcopy(rows)
    i = rng.randrange(len(rows))
    enc = lambda rs: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rs).encode()  # noqa: E731
    if kind == "wrong_type":
        field = rng.choice(["sample_id", "completion"])
        rows[i][field] = rng.choice([None, 7, 2.5, True] + ([[1], {"a": 1}] if field == "sample_id" else []))
    elif kind == "missing":
        del rows[i][rng.choice(["sample_id", "completion"])]
    elif kind == "extra":
        rows[i][rng.choice(["score", "extra", "ключ", "😀", ""])] = rng.choice([1, "x", None, {"a": [1]}])
    elif kind == "huge":
        rows[i][rng.choice(["sample_id", "completion"])] = rng.choice([10**30, -(2**63), 10**4000])
    elif kind == "unicode_id":
        rows[i]["sample_id"] = rng.choice(UNICODE) + rows[i]["sample_id"]
    elif kind == "nested":
        depth = rng.choice([200_000, 1_000_000])
        body = enc(rows).decode().splitlines(keepends=True)
        body[i] = '{"sample_id": "I-1", "completion": ' + "[" * depth + "]" * depth + "}\n"
        return f"{kind} line {i + 1} depth {depth}", "".join(body).encode()
    elif kind == "enormous":
        rows[i]["sample_id"] = rng.choice(["A", "☃", "I-1"]) * rng.choice([1_000_000, 3_000_000])
    elif kind == "truncated":
        body = enc(rows)
        starts = [0] + [j + 1 for j, b in enumerate(body) if b == ord("\n")][:-1]
        start = starts[i]
        end = body.index(b"\n", start)
        cut = rng.randrange(start + 1, end)  # inside a line: that line is no longer a JSON object
        return f"{kind} at {cut}/{len(body)}", body[:cut]
    elif kind == "not_utf8":
        body = enc(rows)
        at = rng.randrange(len(body))
        return f"{kind} at {at}", body[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"]) + body[at:]
    elif kind == "not_an_object":
        body = enc(rows).decode().splitlines(keepends=True)
        body[i] = rng.choice(['["I-1", "x"]\n', "42\n", '"I-1"\n', "null\n", "true\n"])
        return f"{kind} line {i + 1}", "".join(body).encode()
    elif kind == "not_json":
        body = enc(rows).decode().splitlines(keepends=True)
        body[i] = rng.choice(["{'sample_id': 'I-1'}\n", '{"sample_id": "I-1",}\n', "sample_id=I-1\n", "{\n"])
        return f"{kind} line {i + 1}", "".join(body).encode()
    elif kind == "empty":
        return kind, rng.choice([b"", b"\n\n", b"   \n"])
    else:
        body = enc(rows).decode().splitlines(keepends=True)
        body[i] = '{"sample_id": "I-1", "completion": ' + rng.choice(["NaN", "Infinity", "-Infinity"]) + "}\n"
        return f"{kind} line {i + 1}", "".join(body).encode()
    return f"{kind} line {i + 1}", enc(rows)


@pytest.mark.skipif(not (DATA_DIR / "aime2025").is_dir(), reason="needs the local AIME 2025 data")
def test_fuzzed_completions_files(tmp_path, capsys):
    """240 mutants of a valid completions file through `kvleague score`: each one line, exit 2."""
    ids = _aime_ids()
    rows = [{"sample_id": s, "completion": f"\\boxed{{{k}}}"} for k, s in enumerate(ids[:6])]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["score", "--task", "aime25", "--completions", str(path), "--data-dir", str(DATA_DIR)]
    rc, out, err = _run_cli(capsys, argv)
    assert rc == 0 and out.startswith("aime25 "), err  # the base file is valid
    rng = random.Random(2020)
    kinds: dict[str, int] = {}
    for i in range(N_MUTANTS):
        what, body = mutate_jsonl(rng, rows)
        path.write_bytes(body)
        rc, out, err = _run_cli(capsys, argv)
        lines = err.splitlines()
        assert rc == 2 and out == "" and len(lines) == 1 and lines[0].startswith("kvleague: error: --completions: "), (
            i,
            what,
            err[-2000:],
        )
        assert "Traceback" not in err and len(lines[0]) <= MAX_LINE, (i, what, err[:2000])
        kinds[what.split()[0]] = kinds.get(what.split()[0], 0) + 1
    assert len(kinds) == 13, kinds
    print(f"fuzzed completions files: {N_MUTANTS}, all exit 2 with one line; by kind: {kinds}")


@pytest.mark.skipif(not (DATA_DIR / "aime2025").is_dir(), reason="needs the local AIME 2025 data")
def test_hostile_input_through_real_processes(tiny_llama, tmp_path):
    """A few spot checks as a user runs them: the `kvleague` entry point, exit 2, one line."""
    cfg_path = tmp_path / "sweep.yaml"
    cfg_path.write_text(yaml.safe_dump(_set(base_config(tiny_llama, tmp_path / "p.db"), ("budgets",), [-64])))
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_bytes(b'{"sample_id": "I-1", "completion": "x", "extra": 1}\n')
    cases = [
        (
            ["sweep", "--config", str(cfg_path)],
            f"kvleague: error: config {cfg_path}: budgets: must be positive integers, got -64\n",
        ),
        (
            ["score", "--task", "aime25", "--completions", str(jsonl), "--data-dir", str(DATA_DIR)],
            "kvleague: error: --completions: line 1: unknown field 'extra'; allowed: sample_id, completion\n",
        ),
    ]
    for argv, expected in cases:
        out = subprocess.run(
            [sys.executable, "-m", "kvleague.cli", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert (out.returncode, out.stderr, out.stdout) == (2, expected, "")
    assert not (tmp_path / "p.db").exists()


# ------------------------------------------------------------------------------------------------
# The dashboard cannot write
# ------------------------------------------------------------------------------------------------


WRITES = [
    "INSERT INTO sweeps (name, config, config_hash, git_commit, environment_id, status, n_cells, n_skipped, n_ok, "
    "n_failed, started_at) VALUES ('x', '{}', 'h', 'c', 1, 'running', 0, 0, 0, 0, '2026-01-01')",
    "UPDATE sample_results SET score = 0",
    "DELETE FROM sample_results",
    "DROP TABLE sample_results",
    "CREATE TABLE evil (x INTEGER)",
]


def _seeded(url: str) -> int:
    from kvleague.db.seed import Seeder
    from kvleague.db.session import get_engine

    s = Seeder(get_engine(url))
    model, method, task = s.model("m"), s.method("full"), s.task("t", "math")
    proto, gen, env, sweep = s.protocol(), s.generation(), s.environment(), s.sweep("seed")
    rows = [
        {
            "cell_key": f"k{i}",
            "sweep_id": sweep,
            "model_id": model,
            "method_spec_id": method,
            "task_id": task,
            "protocol_id": proto,
            "generation_id": gen,
            "environment_id": env,
            "budget": 64,
            "sample_id": f"p{i}",
            "sample_index": 0,
            "seed": 0,
            "status": "ok",
            "correct": True,
            "score": 1.0,
        }
        for i in range(5)
    ]
    return s.write(rows)


def test_dashboard_engine_cannot_write(db_url):
    """Every kind of write through the dashboard's engine fails in the database driver, even after
    the session tries to switch its own protection off; the rows are unchanged."""
    from kvleague.analysis.queries import fingerprint, open_readonly

    url = db_url
    switch_off = "PRAGMA query_only=OFF" if url.startswith("sqlite") else None
    assert _seeded(url) == 5
    engine = open_readonly(url)
    before = fingerprint(engine)
    for sql in WRITES:
        with engine.connect() as conn:
            if switch_off:  # mode=ro is the file's open mode: a pragma cannot lift it
                conn.exec_driver_sql(switch_off)
            with pytest.raises(DBAPIError, match="(?i)read-?only|query_only"):
                conn.execute(text(sql))
                conn.commit()
    assert fingerprint(engine) == before == (before[0], 5)
    engine.dispose()


# ------------------------------------------------------------------------------------------------
# kvleague bench store: the import of exported (benchmark) reports
# ------------------------------------------------------------------------------------------------


def mutate_report(rng: random.Random, report: dict) -> tuple[str, bytes]:
    from kvleague.db.models import Environment
    from kvleague.runner.bench.harness import ENVIRONMENT_KEYS, FIGURE_KEYS

    STORED_ENV = [k for k in ENVIRONMENT_KEYS if k in Environment.__table__.columns]

    kind = rng.choice(
        [
            "wrong_type",
            "missing",
            "extra",
            "huge",
            "negative_budget",
            "unicode",
            "nested",
            "enormous",
            "truncated",
            "not_utf8",
            "not_an_object",
            "bad_date",
            "non_finite",
        ]
    )
    r = copy.deepcopy(report)
    fig = r["figures"][rng.randrange(len(r["figures"]))]
    if kind == "wrong_type":
        where = rng.choice(["top", "figure", "environment"])
        if where == "top":
            key = rng.choice(
                [
                    "schema_version",
                    "benchmark",
                    "run_id",
                    "created_at",
                    "environment",
                    "config",
                    "rows",
                    "figures",
                    "summary",
                ]
            )
            r[key] = {"a": 1} if isinstance(report[key], list) else rng.choice([[1], None])
        elif where == "figure":
            key = rng.choice(list(FIGURE_KEYS))
            fig[key] = rng.choice([[1], {"a": 1}] if key != "details" else [[1], "x", 3])
        else:  # a field stored in the environments table (the others, like load_average, are not stored)
            r["environment"][rng.choice(STORED_ENV)] = rng.choice([[1, 2], {"a": [1]}])
    elif kind == "missing":
        where = rng.choice(["top", "figure", "environment"])
        if where == "top":
            del r[
                rng.choice(["schema_version", "benchmark", "run_id", "created_at", "environment", "config", "figures"])
            ]
        elif where == "figure":
            del fig[rng.choice(list(FIGURE_KEYS))]
        else:
            del r["environment"][rng.choice(ENVIRONMENT_KEYS)]
    elif kind == "extra":
        fig[rng.choice(["extra", "ключ", "😀", "row_key"])] = rng.choice([1, "x", None])
    elif kind == "huge":
        fig[rng.choice(["budget", "value"])] = rng.choice([INT32 + 1, 2**63, 10**40]) if rng.random() < 0.5 else 10**400
    elif kind == "negative_budget":
        fig["budget"] = rng.choice([-1, 0, -(2**40)])
    elif kind == "unicode":
        key = rng.choice(["benchmark", "schema_version"])
        r[key] = rng.choice(UNICODE) + "decode_speed"
    elif kind == "nested":
        body = json.dumps(r).replace('"summary": {}', '"summary": ' + "[" * 200_000 + "]" * 200_000, 1)
        return kind, body.encode()
    elif kind == "enormous":
        r[rng.choice(["run_id", "benchmark", "created_at"])] = "A" * rng.choice([300, 3_000_000])
        if r.get("run_id") and len(r["run_id"]) == 300:
            r["benchmark"] = "☃" * 1_000_000
    elif kind == "truncated":
        body = json.dumps(r).encode()
        return kind, body[: rng.randrange(0, len(body) - 1)]
    elif kind == "not_utf8":
        body = json.dumps(r, ensure_ascii=False).encode()
        at = rng.randrange(len(body))
        return kind, body[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"]) + body[at:]
    elif kind == "not_an_object":
        return kind, rng.choice([b"[]", b"42", b'"report"', b"null", b""])
    elif kind == "bad_date":
        r["created_at"] = rng.choice(["yesterday", "2026-13-45T00:00:00", "", "☃"])
    else:
        return kind, json.dumps(r).replace('"value": ', '"value": NaN, "x": ', 1).encode()
    return kind, json.dumps(r, ensure_ascii=False).encode()


def test_fuzzed_benchmark_reports(tmp_path, capsys):
    """240 mutants of a valid exported report through `kvleague bench store`: each one line, exit 2,
    and nothing in the database (no figure, no environment row)."""
    from kvleague.runner.bench import harness as h

    figures = [
        h.figure("speed_ratio", 1.25, "x", method="epikv", budget=256, reference="full", clock="cpu"),
        h.figure("max_tokens", 4096, "tokens", method="h2o", budget=1024, at_least=False),
    ]
    report = h.make_report(
        "decode_speed",
        config={"model": "m"},
        rows=[{"method": "epikv"}],
        figures=figures,
        summary={},
        env=h.environment(),
    )
    path = tmp_path / "r.json"
    db = tmp_path / "bench.db"
    url = f"sqlite:///{db}"
    from kvleague.db.session import get_engine, upgrade

    upgrade(get_engine(url))
    rng = random.Random(202)
    kinds: dict[str, int] = {}
    for i in range(N_MUTANTS):
        kind, body = mutate_report(rng, report)
        path.write_bytes(body)
        rc, out, err = _run_cli(capsys, ["bench", "store", str(path), "--db", url])
        lines = err.splitlines()
        assert rc == 2 and out == "" and len(lines) == 1 and lines[0].startswith(f"kvleague: error: {path}: "), (
            i,
            kind,
            err[-2000:],
        )
        assert "Traceback" not in err and len(lines[0]) <= MAX_LINE, (i, kind, err[:2000])
        kinds[kind] = kinds.get(kind, 0) + 1
    with get_engine(url).connect() as conn:
        assert (
            conn.execute(
                text("SELECT (SELECT count(*) FROM benchmark_results) + (SELECT count(*) FROM environments)")
            ).scalar()
            == 0
        )
    assert len(kinds) == 13, kinds
    path.write_text(json.dumps(report))
    assert _run_cli(capsys, ["bench", "store", str(path), "--db", url])[0] == 0  # the unmutated report is stored
    print(f"fuzzed benchmark reports: {N_MUTANTS}, all exit 2 with one line, nothing stored; by kind: {kinds}")
