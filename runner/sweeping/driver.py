"""The sweep driver: expand the grid, record its dimension rows and the sweep, skip the cells whose key
already has a row (so an interrupted sweep resumes where it stopped and a finished one re-runs in
seconds without writing anything), run the rest on Ray and write their rows through the single writer.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvleague.engine.errors import KvleagueError
from kvleague.runner.sweep_config import SweepConfig
from kvleague.runner.sweeping.checks import project_dir
from kvleague.runner.sweeping.grid import Cell, batches, expand
from kvleague.runner.sweeping.progress import Progress
from kvleague.runner.sweeping.scheduler import Scheduler
from kvleague.runner.sweeping.writer import ResultWriter, display


@dataclass
class SweepSummary:
    sweep_id: int
    total: int
    skipped: int
    ran: int
    ok: int
    failed: int
    seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)


def ray_job_submission_id() -> str | None:
    """The Ray Jobs submission id when this driver runs as a Ray job."""
    text = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if text:
        try:
            found = json.loads(text).get("metadata", {}).get("job_submission_id")
            if found:
                return str(found)
        except (ValueError, AttributeError):
            pass
    return os.environ.get("RAY_JOB_SUBMISSION_ID")


class SweepRunner:
    def __init__(
        self,
        config: SweepConfig,
        *,
        db_url: str | None = None,
        config_path: str | None = None,
        ray_address: str | None = None,
        retry_failed: bool = False,
        inject_failures: list[dict[str, Any]] | None = None,
        on_result: Callable[[SweepRunner, dict[str, Any]], None] | None = None,
        progress: bool = True,
        base_dir: Path | None = None,
        workers: int | None = None,
    ):
        self.config = config
        self.base_dir = base_dir or project_dir()
        self.db_url = db_url or config.database
        self.config_path = config_path
        self.ray_address = ray_address
        self.retry_failed = retry_failed
        self.on_result = on_result
        self.show_progress = progress
        self.scheduler = Scheduler(
            config.resources, ray_address=ray_address, workers=workers, inject_failures=inject_failures or []
        )

    @property
    def actors(self) -> list[Any]:
        """The cell actors while the sweep runs (empty before and after)."""
        return self.scheduler.actors

    @property
    def replacements(self) -> int:
        """Actors replaced because they died or hung."""
        return self.scheduler.replacements

    @property
    def _started_ray(self) -> bool:
        return self.scheduler.started_ray

    def run(self) -> SweepSummary:
        from sqlalchemy.exc import SQLAlchemyError

        from kvleague.db import store
        from kvleague.db.session import error_reason, get_engine, retrying, upgrade
        from kvleague.runner.provenance import collect_environment, resolved_git_state

        t0 = time.monotonic()
        grid = expand(self.config, self.base_dir)
        for w in grid.warnings:
            print(f"warning: {w}", file=sys.stderr, flush=True)
        engine = get_engine(self.db_url, self.base_dir)
        upgrade(engine)

        def db(fn: Callable[[], Any], what: str) -> Any:  # a server restarting, another driver writing: wait
            return retrying(engine, fn, what, self.config.resources.db_retry_seconds)

        dim_ids: dict[str, dict[str, int]] = {}
        for dim, rows in grid.dims.items():
            dim_ids[dim] = db(
                lambda: {h: store.get_or_create(engine, store.DIMENSIONS[dim], values) for h, values in rows.items()},  # noqa: B023 - called before the loop moves on
                f"recording the {dim} rows",
            )
        # an uploaded Ray working dir has no .git: then the checkout it came from tells
        commit, dirty = resolved_git_state(self.base_dir)
        self.scheduler.git = (commit, dirty)
        driver_env = collect_environment(git=(commit, dirty))
        driver_env_id = db(lambda: store.environment_id(engine, driver_env), "recording the environment")
        sweep_id = db(
            lambda: store.start_sweep(
                engine,
                {
                    "name": self.config.name,
                    "config": {**self.config.canonical(), "database": display(engine)},
                    "config_hash": self.config.config_hash(),
                    "config_path": self.config_path,
                    "git_commit": commit,
                    "git_dirty": dirty,
                    "environment_id": driver_env_id,
                    "ray_address": self.ray_address or os.environ.get("RAY_ADDRESS"),
                    "ray_job_id": ray_job_submission_id(),
                    "n_cells": len(grid.cells),
                },
            ),
            "recording the sweep",
        )
        keys = [c.key for c in grid.cells]
        existing = db(lambda: store.existing_status(engine, keys), "reading which cells are done")
        pending = [
            c for c in grid.cells if c.key not in existing or (self.retry_failed and existing[c.key] == "failed")
        ]
        skipped = len(grid.cells) - len(pending)
        print(
            f"sweep {self.config.name} (#{sweep_id}): {len(grid.cells)} cells, {skipped} already in "
            f"{display(engine)}, {len(pending)} to run",
            flush=True,
        )
        ok = failed = 0
        status = "crashed"
        try:
            if pending:
                ok, failed = self._run_cells(engine, sweep_id, pending, dim_ids)
            status = "finished"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except KvleagueError:  # said in one line: a database lost, full or read-only
            status = "stopped"
            raise
        finally:
            try:
                retrying(
                    engine,
                    lambda: store.finish_sweep(engine, sweep_id, status, n_skipped=skipped, n_ok=ok, n_failed=failed),
                    f"marking sweep #{sweep_id} {status}",
                    min(30.0, self.config.resources.db_retry_seconds),
                )
            except (KvleagueError, SQLAlchemyError) as exc:  # the results matter; they are written (or said not to be)
                print(f"warning: marking sweep #{sweep_id} {status}: {error_reason(exc)}", file=sys.stderr, flush=True)
            self.scheduler.shutdown()
        summary = SweepSummary(
            sweep_id=sweep_id,
            total=len(grid.cells),
            skipped=skipped,
            ran=len(pending),
            ok=ok,
            failed=failed,
            seconds=time.monotonic() - t0,
            keys=keys,
        )
        summary.rows = db(lambda: store.summary(engine, keys), "reading the summary")
        return summary

    def _run_cells(
        self, engine, sweep_id: int, pending: list[Cell], dim_ids: dict[str, dict[str, int]]
    ) -> tuple[int, int]:
        """Run ``pending`` on the scheduler, each row to the writer; (ok, failed)."""
        writer = ResultWriter(engine, self.config.resources, replace_failed=self.retry_failed)
        progress = Progress(len(pending), self.config.name, bar=self.show_progress)
        counts = collections.Counter()
        unbound_budgets: set[int] = set()

        def record(cell: Cell, row: dict[str, Any]) -> None:
            row.update(
                sweep_id=sweep_id,
                budget=cell.budget,
                sample_id=cell.sample_id,
                sample_index=cell.sample_index,
                seed=cell.seed,
                attempts=cell.attempts,
                measure=cell.measure,
                **{f"{dim}_id": dim_ids[dim][h] for dim, h in cell.dims.items() if dim != "method"},
                method_spec_id=dim_ids["method"][cell.dims["method"]],
            )
            writer.add(row)
            counts["ok" if row["status"] == "ok" else "failed"] += 1
            unbound = (row.get("details") or {}).get("budget_never_binds")
            if unbound and cell.budget not in unbound_budgets:  # once per budget; each row says it too
                unbound_budgets.add(cell.budget)
                print(f"warning: {unbound} (budget {cell.budget:,} in this sweep)", file=sys.stderr, flush=True)
            if self.on_result is not None:
                self.on_result(self, row)

        def tick() -> None:
            writer.flush()
            progress.update(counts["ok"] + counts["failed"], counts["failed"])

        try:
            self.scheduler.run(batches(pending, self.config.batch_size), record, tick, self.config.batch_size)
        finally:
            writer.flush(force=True)
            progress.close()
        return counts["ok"], counts["failed"]


def print_summary(summary: SweepSummary, file=None) -> None:
    out = file or sys.stdout
    print(
        f"sweep #{summary.sweep_id}: {summary.total} cells ({summary.skipped} already done, {summary.ran} run: "
        f"{summary.ok} ok, {summary.failed} failed) in {summary.seconds:.1f}s",
        file=out,
    )
    if not summary.rows:
        return
    header = (
        f"{'model':<18} {'task':<28} {'method':<16} {'budget':>7} {'cells':>6} {'ok':>5} {'failed':>6} {'score':>7}"
    )
    print(header, file=out)
    variants: dict[str, set] = collections.defaultdict(set)
    task_options: dict[str, list[dict]] = collections.defaultdict(list)
    for r in summary.rows:
        variants[r["method"]].add(r["params"])
        if r["task_options"] not in task_options[r["task"]]:
            task_options[r["task"]].append(r["task_options"])
    for r in summary.rows:
        score = "-" if r["mean_score"] is None else f"{r['mean_score']:.3f}"
        method = r["method"] if len(variants[r["method"]]) == 1 else f"{r['method']}{r['params']}"
        task = r["task"] + _distinguishing(r["task_options"], task_options[r["task"]])
        # a fidelity row has no score: its mean KL to the full cache and top-1 agreement instead
        fidelity = (
            "" if r.get("mean_kl") is None else f"  fidelity: KL {r['mean_kl']:.4f}, top-1 {100 * r['mean_top1']:.1f}%"
        )
        print(
            f"{r['model'][:18]:<18} {task[:28]:<28} {method[:16]:<16} {r['budget']:>7} {r['cells']:>6} {r['ok']:>5} {r['failed']:>6} {score:>7}{fidelity}",
            file=out,
        )


def _distinguishing(options: dict, siblings: list[dict]) -> str:
    """``[k=v,...]`` for the options in which a task spec differs from same-named ones ("" if alone)."""
    if len(siblings) < 2:
        return ""
    keys = sorted({k for o in siblings for k in o if len({json.dumps(x.get(k), sort_keys=True) for x in siblings}) > 1})
    return "[" + ",".join(f"{k}={options.get(k)}" for k in keys) + "]"
