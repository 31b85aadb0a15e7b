"""Sweep configs: the shipped ones validate, bad ones give one line and exit code 2, the grid is
deterministic, and ray_cluster.yaml validates against Ray's own cluster-config schema."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvleague.runner.sweep import expand
from kvleague.runner.sweep import main as sweep_main
from kvleague.runner.sweep_config import parse_config
from kvleague.runner.sweeping.checks import load_checked_config, project_dir

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from kvleague.runner.models.tiny import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("sweep-cfg") / "tiny-llama", seed=0)


def base_config(model: Path, tmp: Path) -> dict:
    return {
        "name": "cfg-test",
        "database": f"sqlite:///{tmp / 'cfg.db'}",
        "models": [{"source": str(model), "dtype": "float32"}],
        "methods": ["full", {"name": "streaming_llm", "grid": {"n_sink": [2, 4]}}],
        "budgets": [32, 64],
        "tasks": [{"name": "kv_agent", "limit": 2}],
        "protocol": {"sink": 2, "recent": 4, "protect_prompt": False},
        "generation": {"max_new_tokens": 4},
        "seeds": [0],
    }


def _set(cfg: dict, path: str, value) -> dict:
    cfg = copy.deepcopy(cfg)
    node = cfg
    parts = path.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if p.isdigit() else node[p]
    last = parts[-1]
    if value is _DELETE:
        del node[last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return cfg


_DELETE = object()

# (id, path to change, new value, text the one-line error must contain)
INVALID = [
    ("unknown-backend", "models.0.backend", "vllm", "models[0].backend: Input should be 'hf' or 'slab'"),
    ("unknown-method", "methods.0", "no_such_method", "methods[0].name: unknown 'no_such_method'; valid names:"),
    ("unknown-task", "tasks.0.name", "no_such_task", "tasks[0].name: unknown 'no_such_task'; valid names:"),
    ("negative-budget", "budgets", [64, -8], "budgets: must be positive integers, got -8"),
    ("zero-budget", "budgets", [0], "budgets: must be positive integers, got 0"),
    ("unknown-top-level-field", "colour", "blue", "colour: unknown field; allowed: name, description, database"),
    ("unknown-nested-field", "protocol.sinkk", 3, "protocol.sinkk: unknown field; allowed: cadence, positions, sink"),
    ("bad-db-backend", "database", "mysql://u@127.0.0.1/x", "database: unsupported backend 'mysql'"),
    ("unparseable-db-url", "database", "not a url", "database: cannot parse 'not a url'"),
    (
        "bad-db-driver",
        "database",
        "postgresql+asyncpg://u@127.0.0.1/x",
        "database: unsupported PostgreSQL driver 'asyncpg'",
    ),
    (
        "sqlite-dir-missing",
        "database",
        "sqlite:////nonexistent-dir-kvl/x.db",
        "database: directory '/nonexistent-dir-kvl'",
    ),
    (
        "unknown-hyperparameter",
        "methods.1",
        {"name": "streaming_llm", "params": {"bogus": 1}},
        "methods[1]: method streaming_llm: unknown hyperparameter 'bogus'; valid: n_sink",
    ),
    (
        "bad-hyperparameter-type",
        "methods.1",
        {"name": "streaming_llm", "params": {"n_sink": "many"}},
        "methods[1]: method streaming_llm: hyperparameter n_sink='many'",
    ),
    (
        "grid-and-params",
        "methods.1",
        {"name": "streaming_llm", "params": {"n_sink": 2}, "grid": {"n_sink": [4]}},
        "methods[1].grid.n_sink: also set in params",
    ),
    (
        "empty-grid",
        "methods.1",
        {"name": "streaming_llm", "grid": {"n_sink": []}},
        "methods[1].grid.n_sink: needs at least one value",
    ),
    ("method-twice", "methods.0", "streaming_llm", "is listed twice"),
    (
        "bad-dtype",
        "models.0.dtype",
        "float8",
        "models[0].dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'",
    ),
    (
        "bad-attn",
        "models.0.attn_implementation",
        "magic",
        "models[0].attn_implementation: Input should be 'sdpa', 'eager' or 'flash_attention_2'",
    ),
    (
        "model-dir-missing",
        "models.0.source",
        "./no/such/checkpoint",
        "models[0].source: no checkpoint directory or .gguf file at",
    ),
    (
        "bad-cadence",
        "protocol.cadence",
        "sometimes",
        "protocol.cadence: unknown 'sometimes'; allowed: every_step, buffer=N",
    ),
    ("budget-below-sink-recent", "budgets", [6, 64], "budgets: 6 leaves no evictable slot after sink (2) + recent (4)"),
    ("negative-sink", "protocol.sink", -1, "protocol.sink: Input should be greater than or equal to 0"),
    ("greedy-n-samples", "generation.n_samples", 4, "generation.n_samples: greedy decoding"),
    ("top-p-above-one", "generation.top_p", 1.5, "generation.top_p: Input should be less than or equal to 1"),
    ("missing-models", "models", _DELETE, "models: required field is missing"),
    ("empty-budgets", "budgets", [], "budgets: List should have at least 1 item"),
    ("duplicate-budgets", "budgets", [64, 64], "budgets: duplicate budget"),
    ("task-limit-zero", "tasks.0.limit", 0, "tasks[0].limit: Input should be greater than or equal to 1"),
    (
        "unknown-task-option",
        "tasks.0.options",
        {"n_rooms": 3},
        "tasks[0].options: task kv_agent: unknown option 'n_rooms'; valid:",
    ),
    ("unknown-domain", "protocol_by_domain", {"chemistry": {"sink": 1}}, "protocol_by_domain.chemistry"),
    ("bad-name", "name", "has spaces", "name: String should match pattern"),
    (
        "unset-env-var",
        "database",
        "${KVLEAGUE_TEST_SURELY_UNSET_VAR}",
        "environment variable KVLEAGUE_TEST_SURELY_UNSET_VAR is not set",
    ),
    ("negative-seed", "seeds", [-1], "seeds: must be >= 0, got -1"),
    (
        "bad-resources",
        "resources",
        {"gpus_per_worker": -1},
        "resources.gpus_per_worker: Input should be greater than or equal to 0",
    ),
    (
        "fidelity-without-reference",
        "tasks.0",
        {"name": "aime25", "measure": "fidelity"},
        "tasks[0].measure: aime25 has no reference continuation, so 'fidelity' cannot be measured; allowed for it: generation",
    ),
    (
        "both-without-reference",
        "tasks.0",
        {"name": "aime25", "measure": "both"},
        "tasks[0].measure: aime25 has no reference",
    ),
    (
        "unknown-measure",
        "tasks.0.measure",
        "accuracy",
        "tasks[0].measure: Input should be 'generation', 'fidelity' or 'both'",
    ),
    (
        "zero-scored-tokens",
        "fidelity",
        {"max_scored_tokens": 0},
        "fidelity.max_scored_tokens: Input should be greater than or equal to 1",
    ),
]


def _run(argv, capsys) -> tuple[int, list[str]]:
    rc = sweep_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_config_is_one_line_and_exit_2(case, tiny_llama, tmp_path, capsys):
    _, path, value, expected = case
    cfg = _set(base_config(tiny_llama, tmp_path), path, value)
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    rc, err = _run(["--config", str(config_file), "--dry-run"], capsys)
    assert rc == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"kvleague: error: config {config_file}: "), err[0]
    assert expected in err[0], err[0]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: [unclosed\n", "invalid YAML at line"),
        ("- just\n- a list\n", "top level: expected a mapping of fields, got list"),
    ],
    ids=["yaml-syntax", "not-a-mapping"],
)
def test_unreadable_configs(text, expected, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    rc, err = _run(["--config", str(path), "--dry-run"], capsys)
    assert rc == 2 and len(err) == 1 and expected in err[0], err


def test_missing_file_and_bad_flags(tmp_path, tiny_llama, capsys):
    rc, err = _run(["--config", str(tmp_path / "nope.yaml")], capsys)
    assert rc == 2 and len(err) == 1 and "config: no such file" in err[0]
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(base_config(tiny_llama, tmp_path)))
    for argv, expected in [
        (["--config", str(good), "--workers", "0"], "--workers: must be >= 1"),
        (["--config", str(good), "--limit", "-1"], "--limit: must be >= 1"),
        (["--config", str(good), "--db", "oracle://x/y"], "database: unsupported backend 'oracle'"),
        (["--config", str(good), "--inject-failure", "{not json"], "--inject-failure: not JSON"),
        (["--config", str(good), "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    ]:
        rc, err = _run(argv, capsys)
        assert rc == 2 and len(err) == 1 and expected in err[0], (argv, err)


def test_script_and_cli_exit_2_in_a_real_process(tmp_path, tiny_llama):
    """What a Ray job runs: ``python runner/sweep.py`` (runner/ on sys.path), and ``kvleague sweep``."""
    cfg = _set(base_config(tiny_llama, tmp_path), "methods.0", "no_such_method")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for argv in ([sys.executable, "runner/sweep.py"], [sys.executable, "-m", "kvleague.cli", "sweep"]):
        out = subprocess.run(
            [*argv, "--config", str(path), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "methods[0].name: unknown 'no_such_method'" in lines[0], out.stderr


def test_shipped_configs_validate():
    demo = load_checked_config(
        REPO / "sweeps" / "demo.yaml"
    )  # full semantic check: the default model's wheel is installed
    assert {m.name for m in demo.methods} >= {"full", "streaming_llm", "knorm", "h2o", "snapkv", "tova", "epikv"}
    assert len(demo.budgets) == 2
    assert demo.models[0].source == "smollm2-135m" and [t.name for t in demo.tasks] == ["niah"]
    rep = load_checked_config(REPO / "sweeps" / "replication.yaml")  # full semantic check: every name is registered
    assert rep.models[0].source.startswith("deepseek-ai/DeepSeek-R1-Distill")
    assert rep.budgets == [512, 1024, 2048, 4096, 8192]
    from kvleague.methods.registry import available_methods
    from kvleague.tasks.registry import task_class

    assert {m.name for m in rep.methods} == set(available_methods())
    assert {task_class(t.name).domain for t in rep.tasks} == {"math", "code", "agentic", "longqa"}


def test_grid_and_cell_keys_are_deterministic(tiny_llama, tmp_path):
    cfg = base_config(tiny_llama, tmp_path)
    grid = expand(parse_config(cfg))
    # methods: full + streaming_llm x 2 grid points; 2 budgets; 2 samples; 1 seed
    assert len(grid.cells) == 3 * 2 * 2
    keys = [c.key for c in grid.cells]
    assert len(set(keys)) == len(keys)
    assert keys == [c.key for c in expand(parse_config(copy.deepcopy(cfg))).cells]
    # the database URL and resources do not change what a cell computes; a budget does
    moved = {**cfg, "database": f"sqlite:///{tmp_path / 'other.db'}", "resources": {"batch_size": 3}}
    assert keys == [c.key for c in expand(parse_config(moved)).cells]
    other = expand(parse_config({**cfg, "budgets": [32, 48]})).cells
    assert {c.key for c in other if c.budget == 32} == {c.key for c in grid.cells if c.budget == 32}
    assert not {c.key for c in other if c.budget == 48} & set(keys)
    # the canonical hyperparameters are in the key: an explicit default equals the implicit one
    explicit = {**cfg, "methods": [{"name": "full"}, {"name": "streaming_llm", "grid": {"n_sink": [2, 4]}}]}
    assert keys == [c.key for c in expand(parse_config(explicit)).cells]
    # the backend, named or left to its default (hf), changes neither the cells' keys nor the sweep's hash
    named = {**cfg, "models": [{**cfg["models"][0], "backend": "hf"}]}
    assert keys == [c.key for c in expand(parse_config(named)).cells]
    assert parse_config(named).config_hash() == parse_config(cfg).config_hash()
    assert all("backend" not in c.model for c in grid.cells)


def test_n_samples_and_seeds_expand(tiny_llama, tmp_path):
    cfg = {
        **base_config(tiny_llama, tmp_path),
        "methods": ["full"],
        "budgets": [64],
        "seeds": [0, 1],
        "generation": {"temperature": 0.7, "n_samples": 3, "max_new_tokens": 4},
    }
    cells = expand(parse_config(cfg)).cells
    assert len(cells) == 2 * 3 * 2  # samples x n_samples x seeds
    assert len({(c.sample_id, c.gen_seed, c.seed) for c in cells}) == len(cells)


def test_optional_unregistered_task_is_skipped_with_a_warning(tiny_llama, tmp_path):
    cfg = {
        **base_config(tiny_llama, tmp_path),
        "tasks": [{"name": "kv_agent", "limit": 1}, {"name": "not_yet_written", "optional": True}],
    }
    grid = expand(parse_config(cfg))
    assert any("not_yet_written" in w for w in grid.warnings)
    assert {c.task for c in grid.cells} == {"kv_agent"}


def test_project_dir_inside_an_uploaded_ray_working_dir(tmp_path, monkeypatch):
    """A Ray job's cwd is an uploaded copy without ignored files: relative paths go to the checkout."""
    from kvleague.runner.sweeping.checks import editable_checkout

    checkout = editable_checkout()
    if checkout is None:
        pytest.skip("kvleague is not an editable install here")
    fake = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    fake.mkdir(parents=True)
    monkeypatch.delenv("KVLEAGUE_PROJECT_DIR", raising=False)
    monkeypatch.chdir(fake)
    assert project_dir() == checkout
    monkeypatch.setenv("KVLEAGUE_PROJECT_DIR", str(tmp_path))
    assert project_dir() == tmp_path.resolve()


def test_ray_cluster_yaml_validates_against_rays_schema():
    import jsonschema
    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    config = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    validate_config(prepare_config(copy.deepcopy(config)))  # Ray's own check, defaults filled in
    gpu_types = [t for t in config["available_node_types"].values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu_types, "a GPU worker type"
    assert any("pip install" in c and "-e" in c for c in config["setup_commands"])
    # a schema violation is caught (the test can fail)
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_a_method_that_needs_eager_attention_is_announced(tiny_llama, tmp_path):
    cfg = base_config(tiny_llama, tmp_path)
    cfg["methods"] = ["full", "h2o", {"name": "h2o", "params": {"recent_ratio": 0.25}}]
    warnings = expand(parse_config(cfg)).warnings
    eager = [w for w in warnings if "eager" in w]
    assert (
        len(eager) == 1 and eager[0].startswith("method h2o: needs eager attention") and "instead of sdpa" in eager[0]
    )
    cfg["models"][0]["attn_implementation"] = "eager"  # nothing to announce when the run is eager anyway
    assert not [w for w in expand(parse_config(cfg)).warnings if "eager" in w]


def test_summary_keeps_task_specs_of_one_name_apart(capsys):
    """Two niah lengths are two rows, labelled by the option that differs."""
    from kvleague.runner.sweep import SweepSummary, print_summary

    def row(length, score):
        return {
            "model": "m",
            "task": "niah",
            "task_options": {"context_length": length, "seed": 0},
            "method": "full",
            "params": "{}",
            "budget": 64,
            "cells": 2,
            "ok": 2,
            "failed": 0,
            "mean_score": score,
        }

    print_summary(SweepSummary(1, 4, 0, 4, 4, 0, 1.0, rows=[row(512, 1.0), row(1024, 0.5)]))
    lines = capsys.readouterr().out.splitlines()
    assert any("niah[context_length=512]" in ln and ln.rstrip().endswith("1.000") for ln in lines)
    assert any("niah[context_length=1024]" in ln and ln.rstrip().endswith("0.500") for ln in lines)


def test_no_progress_still_prints_a_heartbeat(monkeypatch, capsys):
    """--no-progress (bar=False) prints a status line every 60 s, even while no cell finishes."""
    from kvleague.runner.sweeping import progress as sweep_progress

    clock = [1000.0]
    monkeypatch.setattr(sweep_progress.time, "monotonic", lambda: clock[0])
    progress = sweep_progress.Progress(10, "demo", bar=False)
    progress.update(0, 0)
    clock[0] += 59
    progress.update(0, 0)
    assert capsys.readouterr().out == ""
    clock[0] += 2
    progress.update(0, 0)
    assert capsys.readouterr().out.startswith("[demo] 0/10 cells done, 0 failed")
    clock[0] += 61
    progress.update(3, 1)
    assert "3/10 cells done, 1 failed" in capsys.readouterr().out


def test_fidelity_cells_never_share_a_key_with_generation_cells(tiny_llama, tmp_path):
    """``measure: both`` adds one fidelity cell per (method, budget, sample, seed) - never n_samples of
    them - whose keys are new; the generation cells keep the keys a generation-only config gives them,
    so a database written before fidelity existed resumes as before."""
    cfg = {
        **base_config(tiny_llama, tmp_path),
        "seeds": [0, 1],
        "generation": {"temperature": 0.7, "n_samples": 2, "max_new_tokens": 4},
    }
    generation_only = expand(parse_config(cfg)).cells
    both = expand(parse_config(_set(cfg, "tasks.0.measure", "both"))).cells
    fidelity_only = expand(parse_config(_set(cfg, "tasks.0.measure", "fidelity"))).cells
    gen = [c for c in both if c.measure == "generation"]
    fid = [c for c in both if c.measure == "fidelity"]
    assert [c.key for c in gen] == [c.key for c in generation_only]
    assert [c.key for c in fid] == [c.key for c in fidelity_only]
    # (full at its first budget only + streaming_llm's 2 points x 2 budgets) x 2 samples x 2 seeds, sample index 0
    assert len(fid) == (1 + 2 * 2) * 2 * 2 and {c.sample_index for c in fid} == {0}
    assert {c.budget for c in fid if c.method == "full"} == {32}
    assert len({c.key for c in both}) == len(both)
    assert all(c.generation == {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "stop": []} for c in fid)
    # a sample's fidelity cells are queued together (one worker computes its full-cache pass once)
    order = [c.sample_id for c in fidelity_only]
    assert order == sorted(order, key=order.index)
    # the cap on scored tokens is part of what a fidelity cell computes
    capped = expand(
        parse_config({**_set(cfg, "tasks.0.measure", "fidelity"), "fidelity": {"max_scored_tokens": 16}})
    ).cells
    assert not {c.key for c in capped} & {c.key for c in fidelity_only}


def test_a_cells_row_carries_every_engine_metric_to_the_database(tiny_llama, tmp_path):
    """A cell run by the Ray-free worker, written by the store and read back: every metric of the engine's
    GenerationResult (runner.metrics) reaches its column, selection_seconds included; the figures that are
    not timings equal those of a direct Engine.generate run of the same cell."""
    from sqlalchemy import select

    from kvleague.db import store
    from kvleague.db.models import METRIC_COLUMNS, SampleResult
    from kvleague.db.seed import Seeder
    from kvleague.db.session import get_engine
    from kvleague.engine.protocol import GenerationSettings
    from kvleague.methods.registry import build_method
    from kvleague.runner.sweeping.cell import CellWorker
    from kvleague.tasks.registry import build_task

    cfg = {
        **base_config(tiny_llama, tmp_path),
        "methods": ["streaming_llm"],
        "budgets": [32],
        "tasks": [{"name": "niah", "limit": 1, "options": {"context_length": 96}}],
    }
    config = parse_config(cfg)
    grid = expand(config)
    cell = grid.cells[0]
    worker = CellWorker(torch_threads=1)
    row = worker.run(cell)
    assert row["status"] == "ok", row.get("error")
    engine = get_engine(config.database)
    seeder = Seeder(engine)  # migrates
    ids = {
        f"{dim}_id": store.get_or_create(engine, store.DIMENSIONS[dim], next(iter(rows.values())))
        for dim, rows in grid.dims.items()
    }
    ids["method_spec_id"] = ids.pop("method_id")
    row.pop("environment"), row.pop("model_revision")
    store.write_results(
        engine,
        [
            {
                **row,
                **ids,
                "sweep_id": seeder.sweep("t"),
                "budget": cell.budget,
                "sample_id": cell.sample_id,
                "sample_index": 0,
                "seed": 0,
                "attempts": 1,
            }
        ],
    )
    with engine.connect() as conn:
        stored = conn.execute(select(*[SampleResult.__table__.c[c] for c in METRIC_COLUMNS])).one()._mapping
    assert dict(stored) == {c: row[c] for c in METRIC_COLUMNS}
    model = worker._engine_for(cell.model)
    direct = model.generate(
        task_prompt := build_task(cell.task, cell.task_options).build_prompt(cell.sample, model.tokenizer),
        build_method(cell.method, cell.params),
        cell.budget,
        cell.protocol,
        GenerationSettings(max_new_tokens=cell.generation["max_new_tokens"], stop=tuple(cell.generation["stop"])),
        seed=cell.gen_seed,
    )
    assert len(task_prompt) == stored["prompt_tokens"]
    for name in (
        "generated_tokens",
        "evictions",
        "evicted_tokens",
        "peak_cache_entries",
        "peak_kv_bytes",
        "attn_implementation",
    ):
        assert stored[name] == getattr(direct, name), name
    assert direct.evictions > 0 and stored["selection_seconds"] > 0
