"""A sweep with ``measure: fidelity`` on a tiny random model, through Ray: its rows hold what
``runner.fidelity.measure`` computes for the same sample in this process, full cache is exact, and a
sweep interrupted after a few cells resumes without re-running them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from kvleague.db.session import get_engine
from kvleague.runner.sweep import expand
from kvleague.runner.sweep_config import parse_config

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("KVLEAGUE_DATA_DIR") or REPO.parent / "shared" / "data")

# minutes of Ray, subprocesses or a browser: the slow tier (KVLEAGUE_SLOW=1 bash scripts/test.sh)
pytestmark = pytest.mark.slow

# run in its own process (Ray's process-global state stays out of pytest): once interrupted after
# `stop_after` results (as Ctrl-C would), then again to the end
DRIVER = r"""
import json, sys
from kvleague.runner.sweep import SweepRunner
from kvleague.runner.sweep_config import parse_config

config, stop_after = json.loads(sys.argv[1]), int(sys.argv[2])
seen = [0]

def interrupt(runner, row):
    seen[0] += 1
    if seen[0] == stop_after:
        raise KeyboardInterrupt

try:
    SweepRunner(parse_config(config), ray_address="local", on_result=interrupt, progress=False).run()
    print("RESULT first run finished")
except KeyboardInterrupt:
    pass
s = SweepRunner(parse_config(config), ray_address="local", progress=False).run()
print("RESULT " + json.dumps({"total": s.total, "ran": s.ran, "skipped": s.skipped, "ok": s.ok, "failed": s.failed}))
"""


def _config(model: Path, db_url: str) -> dict:
    return {
        "name": "fidelity-test",
        "database": db_url,
        "data_dir": str(DATA_DIR),
        "models": [{"source": str(model), "name": "tiny-llama", "dtype": "float32"}],
        "methods": ["full", "streaming_llm", "knorm"],
        "budgets": [40, 64],
        "tasks": [{"name": "gsm8k", "limit": 2, "measure": "fidelity"}],
        "protocol": {"sink": 2, "recent": 4, "protect_prompt": False},
        "fidelity": {"max_scored_tokens": 12},
        "resources": {"workers": 1, "cpus_per_worker": 1, "torch_threads": 1, "batch_size": 4, "flush_seconds": 0.1},
        # a sample's cells batched: a row's bits do not depend on its batch (engine/batch_invariance.py),
        # so each row is still what the single path computes for it
        "batch_size": 4,
    }


def test_a_fidelity_sweep_stores_what_measure_computes_and_resumes(tiny_models, engines, tmp_path):
    if not (DATA_DIR / "gsm8k").is_dir():
        pytest.skip("no local GSM8K")
    db_url = f"sqlite:///{tmp_path / 'fidelity.db'}"
    cfg = _config(tiny_models["llama"], db_url)
    cells = expand(parse_config(cfg)).cells
    # full once (at the first budget: it never evicts), the others at both budgets; two samples
    assert len(cells) == (1 + 2 * 2) * 2 and {c.measure for c in cells} == {"fidelity"}
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(cfg), "4"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "first run finished" not in out.stdout  # the first run was interrupted
    second = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1].removeprefix("RESULT "))
    # the interrupted run's finished cells were written and the second run skipped them
    assert second["total"] == len(cells) and second["skipped"] >= 4 and second["skipped"] + second["ran"] == len(cells)
    assert second["failed"] == 0

    with get_engine(db_url).connect() as conn:
        rows = [
            dict(r._mapping)
            for r in conn.execute(
                text(
                    "SELECT r.cell_key, r.status, r.measure, r.budget, r.sample_id, r.seed, r.kl_mean, r.delta_nll_mean, "
                    "r.top1_agreement, r.scored_tokens, r.correct, r.details, s.name AS method, g.max_new_tokens "
                    "FROM sample_results r JOIN method_specs s ON s.id = r.method_spec_id "
                    "JOIN generation_settings g ON g.id = r.generation_id"
                )
            )
        ]
        sweeps = [tuple(r) for r in conn.execute(text("SELECT status, n_ok, n_skipped FROM sweeps ORDER BY id"))]
    assert sorted(r["cell_key"] for r in rows) == sorted(c.key for c in cells)  # one row per cell, none twice
    assert sweeps[0][0] == "interrupted" and sweeps[1] == ("finished", second["ran"], second["skipped"])
    assert all(r["status"] == "ok" and r["measure"] == "fidelity" and r["correct"] is None for r in rows)
    assert all(r["max_new_tokens"] == 12 and r["scored_tokens"] == 12 for r in rows)

    # the independent path: the same samples measured here, one full-cache pass each, compared per row
    from kvleague.engine.protocol import Protocol
    from kvleague.methods.registry import build_method
    from kvleague.runner import fidelity
    from kvleague.tasks.registry import build_task

    engine = engines["llama"]
    task = build_task("gsm8k", {})
    samples = {s.sample_id: s for s in task.load(limit=2, seed=0, data_dir=DATA_DIR)}
    assert {r["sample_id"] for r in rows} == set(samples)
    for r in rows:
        segments = fidelity.truncate(task.fidelity_segments(samples[r["sample_id"]], engine.tokenizer), 12)
        want = fidelity.measure(
            engine, segments, build_method(r["method"]), r["budget"], Protocol(sink=2, recent=4), seed=r["seed"]
        )
        assert r["kl_mean"] == pytest.approx(want.kl_mean, rel=1e-5, abs=1e-9), r
        assert r["delta_nll_mean"] == pytest.approx(want.delta_nll_mean, rel=1e-5, abs=1e-7), r
        assert r["top1_agreement"] == want.top1_agreement, r
        details = json.loads(r["details"]) if isinstance(r["details"], str) else r["details"]
        assert details["fidelity"]["kl_max"] == pytest.approx(want.kl_max, rel=1e-5, abs=1e-9)
        assert details["backend"] == "hf"  # the engine backend that produced the row
        if r["method"] == "full":
            assert r["kl_mean"] <= 1e-6 and r["top1_agreement"] == 1.0
    by = {
        (r["method"], r["budget"]): [
            x["kl_mean"] for x in rows if (x["method"], x["budget"]) == (r["method"], r["budget"])
        ]
        for r in rows
    }
    assert sum(by[("streaming_llm", 40)]) > sum(by[("streaming_llm", 64)]) > 0  # the check above is not vacuous
    # one full-cache pass per sample, shared by that sample's later cells in the run that finished it
    shared = [
        json.loads(r["details"])["fidelity"]["reference_shared"]
        if isinstance(r["details"], str)
        else r["details"]["fidelity"]["reference_shared"]
        for r in rows
    ]
    assert shared.count(False) <= 2 + 2  # a pass per sample per run at most (two runs, two samples)
