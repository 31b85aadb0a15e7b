"""Sweeps on a real local Ray head (127.0.0.1, capped object store): through the Ray Jobs API, with
actors killed mid-sweep, with cells that raise, and re-runs that add nothing; on SQLite and on
PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from sqlalchemy import text

from kvleague.db import store
from kvleague.db.session import get_engine
from kvleague.runner.sweep import SweepRunner, expand
from kvleague.runner.sweep_config import load_config, parse_config

# minutes of Ray, subprocesses or a browser: the slow tier (KVLEAGUE_SLOW=1 bash scripts/test.sh)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("KVLEAGUE_DATA_DIR") or REPO.parent / "shared" / "data")
HAVE_MATH_DATA = (DATA_DIR / "math500" / "test.jsonl").is_file()


def _ray_env() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # this venv's `ray`
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "KVLEAGUE_DATA_DIR": str(DATA_DIR),
        "KVLEAGUE_RAY_CPUS": "2",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "token",
    }


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head started by scripts/ray_head.sh (dashboard + Jobs API on 127.0.0.1); stopped after."""
    state = tmp_path_factory.mktemp("ray-head")
    env = _ray_env()
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "ray_head.sh"), "start", str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        assert out.returncode == 0, out.stderr
        values = dict(
            line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines() if line.startswith("export ")
        )
        assert values["RAY_ADDRESS"].startswith("http://127.0.0.1:")
        yield {"jobs": values["RAY_ADDRESS"], "gcs": values["RAY_GCS"], "env": env}
    finally:
        subprocess.run(
            ["bash", str(REPO / "scripts" / "ray_head.sh"), "stop", str(state)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project directory holding artifacts/tiny-llama (the fast model of the sweep tests)."""
    from kvleague.runner.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("project")
    make_tiny_model("llama", root / "artifacts" / "tiny-llama", seed=0)
    return root


def small_config(project: Path, db_url: str, **over) -> dict:
    # short prompts (fast cells), and one agentic episode so the episodic path runs through Ray too
    tasks = [{"name": "math500", "limit": 2}] if HAVE_MATH_DATA else []
    tasks.append({"name": "kv_agent", "limit": 1 if HAVE_MATH_DATA else 2, "max_new_tokens": 2})
    cfg = {
        "name": "test-sweep",
        "database": db_url,
        "models": [{"source": str(project / "artifacts" / "tiny-llama"), "name": "tiny-llama", "dtype": "float32"}],
        "methods": ["full", "streaming_llm", "knorm"],
        "budgets": [64, 128],
        "tasks": tasks,
        "protocol": {"sink": 4, "recent": 8, "protect_prompt": False},
        "generation": {"max_new_tokens": 6},
        "seeds": [0],
        "resources": {
            "cpus_per_worker": 1,
            "torch_threads": 1,
            "workers": 2,
            "batch_size": 4,
            "flush_seconds": 1,
            "max_restarts": 2,
            "max_task_retries": 1,
        },
    }
    cfg.update(over)
    return cfg


def _rows(db_url: str) -> list[tuple]:
    with get_engine(db_url).connect() as conn:
        return list(conn.execute(text("SELECT cell_key, status, error FROM sample_results ORDER BY cell_key")))


def test_a_head_that_times_out_during_startup_is_started_once_more(tmp_path):
    """Ray gives its processes ~30 s to come up, which a loaded machine (CI) can miss: the head then
    exits "timed out during startup". ``ray_head.sh start`` starts it once more, on fresh ports (here
    a ``ray`` whose first ``start`` fails so); any other failure is reported at once."""
    env = _ray_env()
    real = shutil.which("ray", path=env["PATH"])
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "ray").write_text(
        f'#!/bin/bash\nif [ "$1" = start ] && mkdir {tmp_path / "once"} 2>/dev/null; then\n'
        f"  echo 'Exception: The current node timed out during startup.'; exit 1\nfi\nexec {real} \"$@\"\n"
    )
    (stub / "ray").chmod(0o755)
    env["PATH"] = f"{stub}{os.pathsep}{env['PATH']}"
    script, state = str(REPO / "scripts" / "ray_head.sh"), str(tmp_path / "state")
    out = subprocess.run(["bash", script, "start", state], env=env, capture_output=True, text=True, timeout=240)
    try:
        assert out.returncode == 0 and "starting it once more" in out.stderr, out.stderr
        assert "RAY_ADDRESS=http://127.0.0.1:" in out.stdout
    finally:
        subprocess.run(["bash", script, "stop", state], env=env, capture_output=True, text=True, timeout=120)
    (stub / "ray").write_text(
        f'#!/bin/bash\n[ "$1" = start ] && {{ echo \'Exception: port in use\'; exit 1; }}\nexec {real} "$@"\n'
    )
    out = subprocess.run(["bash", script, "start", state], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 1 and "ray head failed to start" in out.stderr and "once more" not in out.stderr


def test_demo_through_the_ray_jobs_api(ray_head, project, tmp_path):
    """`ray job submit --working-dir . -- python runner/sweep.py --config sweeps/demo.yaml` against the head."""
    db_path = tmp_path / "jobs.db"
    db_url = f"sqlite:///{db_path}"
    runtime_env = {"env_vars": {"KVLEAGUE_PROJECT_DIR": str(project)}}  # where the data and database paths resolve
    cmd = [
        "ray",
        "job",
        "submit",
        "--address",
        ray_head["jobs"],
        "--working-dir",
        ".",
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--",
        "python",
        "runner/sweep.py",
        "--config",
        "sweeps/demo.yaml",
        "--db",
        db_url,
        "--limit",
        "1",
        "--no-progress",
    ]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=REPO, env=ray_head["env"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        subprocess.run(["ray", "job", "list", "--address", ray_head["jobs"]], env=ray_head["env"], timeout=60)
        raise
    assert out.returncode == 0, (out.stdout[-4000:], out.stderr[-4000:])
    assert "succeeded" in out.stdout + out.stderr
    # exactly one row per cell of the demo (the same grid, expanded here)
    os.environ["KVLEAGUE_PROJECT_DIR"] = str(project)
    try:
        config = load_config(REPO / "sweeps" / "demo.yaml")
        for t in config.tasks:
            t.limit = 1
        cells = expand(config).cells
    finally:
        os.environ.pop("KVLEAGUE_PROJECT_DIR", None)
    rows = _rows(db_url)
    assert len(rows) == len(cells) > 0
    assert {r[0] for r in rows} == {c.key for c in cells}
    assert {r[1] for r in rows} == {"ok"}, [r for r in rows if r[1] != "ok"][:3]
    with get_engine(db_url).connect() as conn:
        sweep = conn.execute(text("SELECT status, ray_job_id, n_ok, git_commit FROM sweeps")).one()
        assert sweep[0] == "finished" and sweep[1].startswith("raysubmit_") and sweep[2] == len(cells)
        assert sweep[3] != ""
        env = conn.execute(
            text(
                "SELECT e.python_version, e.torch_version, e.transformers_version, e.hostname, e.kvleague_version, e.gpu_name, "
                "e.git_commit FROM sample_results r JOIN environments e ON e.id = r.environment_id LIMIT 1"
            )
        ).one()
        assert all(v not in (None, "") for v in env)
        assert env[-1] == sweep[3]  # workers ran the uploaded copy: they report the driver's commit
        metrics = conn.execute(
            text(
                "SELECT MIN(prompt_tokens), MIN(generated_tokens), MAX(evictions), MIN(peak_cache_entries), MIN(peak_kv_bytes), "
                "MIN(peak_memory_bytes) FROM sample_results"
            )
        ).one()
        assert all(v is not None and v >= 0 for v in metrics) and metrics[2] > 0
        # the demo's model and task: SmolLM2-135M (converted by the job's workers) finds the needle with a full cache
        full = conn.execute(
            text(
                "SELECT MIN(CAST(r.correct AS INTEGER)), MIN(r.prompt_tokens), COUNT(*), MIN(m.source), MIN(t.name) FROM sample_results r "
                "JOIN method_specs s ON s.id = r.method_spec_id JOIN models m ON m.id = r.model_id "
                "JOIN tasks t ON t.id = r.task_id WHERE s.name = 'full'"
            )
        ).one()
        assert (
            full[0] == 1 and full[1] > 500 and full[2] == len(config.budgets) and full[3:] == ("smollm2-135m", "niah")
        )
    print(f"ray job: {len(cells)} cells in {time.monotonic() - t0:.1f}s")


DRIVER = r"""
import json, sys
import ray
from kvleague.runner.sweep import SweepRunner
from kvleague.runner.sweep_config import parse_config

config, address, failures = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
seen, killed = [0], []

def chaos(runner, row):
    seen[0] += 1
    if seen[0] == 2:  # restartable: Ray restarts the actor and retries its calls
        ray.kill(runner.actors[0], no_restart=False)
        killed.append("restart")
    elif seen[0] == 4:  # gone for good: the driver must replace it
        ray.kill(runner.actors[1], no_restart=True)
        killed.append("no_restart")

runner = SweepRunner(parse_config(config), ray_address=address, on_result=chaos, inject_failures=failures, progress=False)
s = runner.run()
print("RESULT " + json.dumps({"total": s.total, "ran": s.ran, "skipped": s.skipped, "ok": s.ok, "failed": s.failed,
                              "killed": killed, "replacements": runner.replacements, "seconds": s.seconds}))
"""


def _drive(ray_head, config: dict, failures: list[dict], timeout: int = 240) -> dict:
    """Run a sweep driver in its own process (Ray's process-global state stays out of pytest)."""
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(config), ray_head["gcs"], json.dumps(failures)],
        cwd=REPO,
        env=ray_head["env"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def test_killed_actors_and_a_raising_cell(ray_head, project, tmp_path):
    """Kill one actor (restartable) and another (for good) mid-sweep while some cells raise: exactly
    one row per cell, none duplicated or missing, the raising ones stored as failed with their message.
    Then the same sweep again: zero new rows, no Ray, fast. On SQLite: the same writes on PostgreSQL
    are covered by test_faults.py (driver killed, server restarted) and test_db.py."""
    db_url = f"sqlite:///{tmp_path / 'sweep.db'}"
    cfg = small_config(project, db_url)
    cells = expand(parse_config(cfg)).cells
    doomed = {c.key for c in cells if c.method == "knorm" and c.budget == 64}
    assert 0 < len(doomed) < len(cells)
    message = "forced failure: scorer exploded"
    result = _drive(ray_head, cfg, [{"method": "knorm", "budget": 64, "message": message}])
    assert result["killed"] == ["restart", "no_restart"]
    assert result["replacements"] >= 1
    assert (result["ok"], result["failed"]) == (len(cells) - len(doomed), len(doomed))
    rows = _rows(db_url)
    assert len(rows) == len(cells) == result["total"]
    assert {r[0] for r in rows} == {c.key for c in cells}  # none duplicated, none missing
    for key, status, error in rows:
        if key in doomed:
            assert status == "failed" and error.startswith(f"RuntimeError: {message}"), error
        else:
            assert status == "ok" and error is None, error
    # run it again: nothing to do, no rows written, no Ray started, quickly
    t0 = time.monotonic()
    again = SweepRunner(parse_config(small_config(project, db_url)), ray_address=ray_head["gcs"], progress=False)
    summary = again.run()
    elapsed = time.monotonic() - t0
    assert summary.ran == 0 and summary.skipped == len(cells)
    assert again.actors == [] and not again._started_ray
    assert _rows(db_url) == rows
    assert elapsed < 30, elapsed
    with get_engine(db_url).connect() as conn:
        sweeps = [
            tuple(r)
            for r in conn.execute(text("SELECT status, n_cells, n_ok, n_failed, n_skipped FROM sweeps ORDER BY id"))
        ]
    assert sweeps == [
        ("finished", len(cells), len(cells) - len(doomed), len(doomed), 0),
        ("finished", len(cells), 0, 0, len(cells)),
    ]


def test_retry_failed_from_the_command_line(ray_head, project, tmp_path):
    """`python runner/sweep.py` against the head: a failing cell is stored as failed and the sweep
    goes on; `--retry-failed` runs it again and replaces its row."""
    db_url = f"sqlite:///{tmp_path / 'retry.db'}"
    cfg = small_config(project, db_url, methods=["full", "knorm"], budgets=[64])
    cfg["resources"]["workers"] = 1  # each run starts its workers (torch, transformers): one is enough here
    cells = expand(parse_config(cfg)).cells
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    base = [sys.executable, "runner/sweep.py", "--config", str(path), "--address", ray_head["gcs"], "--no-progress"]
    out = subprocess.run(
        [*base, "--inject-failure", json.dumps({"method": "knorm", "message": "boom"})],
        cwd=REPO,
        env=ray_head["env"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    n_knorm = sum(c.method == "knorm" for c in cells)
    assert f"{len(cells) - n_knorm} ok, {n_knorm} failed" in out.stdout, out.stdout[-2000:]
    assert {r[1] for r in _rows(db_url)} == {"ok", "failed"}
    retry = subprocess.run(
        [*base, "--retry-failed"], cwd=REPO, env=ray_head["env"], capture_output=True, text=True, timeout=240
    )
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert f"{n_knorm} run: {n_knorm} ok, 0 failed" in retry.stdout, retry.stdout[-2000:]
    rows = _rows(db_url)
    assert len(rows) == len(cells) and {r[1] for r in rows} == {"ok"}
    assert store.count_results(get_engine(db_url), [c.key for c in cells]) == len(cells)
