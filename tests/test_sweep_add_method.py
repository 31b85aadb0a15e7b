"""A new method beside a finished sweep (issue 50): ``kvleague sweep --config C --methods NAME`` runs
only that method's cells (and the config's full cache, skipped when done) under the config's settings;
a budget no cell can reach is said once and in each of its rows. Ray's stand-in runs the cells in this
process (the scheduler's own tests cover Ray)."""

from __future__ import annotations

import yaml

from kvleague.cli import main
from kvleague.db.session import get_engine
from kvleague.runner.sweep_config import load_config
from kvleague.runner.sweeping import driver
from kvleague.runner.sweeping.cell import CellWorker
from kvleague.runner.sweeping.grid import expand


class InProcess:
    """The scheduler's interface on one in-process CellWorker."""

    def __init__(self, resources, **_):
        self.worker = CellWorker(torch_threads=1)
        self.actors, self.replacements, self.started_ray, self.git = [], 0, False, None

    def run(self, groups, record, tick, batch_size):
        for group in groups:
            for cell, row in zip(group, self.worker.run_group(group, batch_size)):
                record(cell, row)
            tick()

    def shutdown(self):
        pass


def rows(db: str) -> list[tuple]:
    from sqlalchemy import text

    with get_engine(db).connect() as conn:
        return list(
            conn.execute(
                text(
                    "select m.name, r.budget, r.details, r.evictions from sample_results r "
                    "join method_specs m on m.id = r.method_spec_id"
                )
            )
        )


def test_methods_runs_only_the_new_cells_and_a_budget_never_reached_is_said(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(driver, "Scheduler", InProcess)
    db = f"sqlite:///{tmp_path / 'r.db'}"
    config = tmp_path / "demo.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "demo",
                "database": db,
                "models": [{"source": str(tiny_models["llama"]), "dtype": "float32"}],
                "methods": ["full", "streaming_llm", {"name": "knorm", "params": {}}],
                "budgets": [12, 100_000],
                "tasks": [{"name": "gsm8k", "limit": 1, "max_new_tokens": 4}],
                "protocol": {"sink": 2, "recent": 2, "protect_prompt": False},
            }
        )
    )
    demo = load_config(config)
    assert main(["sweep", "--config", str(config), "--methods", "streaming_llm", "--no-progress"]) == 0
    err = capsys.readouterr().err
    first = rows(db)
    assert {(m, b) for m, b, *_ in first} == {(m, b) for m in ("full", "streaming_llm") for b in (12, 100_000)}
    assert err.count("warning: budget 100,000 holds the whole prompt") == 1
    for method, budget, details, evictions in first:
        assert ("budget_never_binds" in details) == (budget == 100_000)
        assert (evictions > 0) == ((method, budget) == ("streaming_llm", 12))
    # the added method: only its cells run (full is done), under the config's settings: its cells are the
    # full config's cells of that method, key for key
    assert main(["sweep", "--config", str(config), "--methods", "knorm", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "4 cells, 2 already in" in out and "2 to run" in out  # full at both budgets: done
    keys = {c.key for c in expand(demo).cells if c.method == "knorm"}
    from sqlalchemy import text

    with get_engine(db).connect() as conn:
        stored = {
            k
            for (k,) in conn.execute(
                text(
                    "select cell_key from sample_results r join method_specs m on m.id = r.method_spec_id where m.name = 'knorm'"
                )
            )
        }
    assert stored == keys and len(rows(db)) == 6
    # a name the registry lacks is one line, exit 2
    assert main(["sweep", "--config", str(config), "--methods", "nope", "--dry-run"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
