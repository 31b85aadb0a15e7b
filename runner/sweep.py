"""Run a sweep on Ray and store every cell's result in SQL: the entry point.

    python runner/sweep.py --config sweeps/demo.yaml            # starts a local Ray on 127.0.0.1
    kvleague sweep --config sweeps/demo.yaml                    # the same
    ray job submit --working-dir . -- python runner/sweep.py --config sweeps/demo.yaml

The sweep itself lives in ``runner/sweeping/``, one module per job: ``grid`` (config -> cells and
their keys), ``cell`` (run one cell, Ray-free), ``scheduler`` (cells on Ray actors, relying on Ray's
restarts and retries), ``writer`` (the single database writer), ``progress`` and ``driver`` (the
whole sweep, resumable). This file is the ``sweep`` command (also ``kvleague sweep``): it parses the
command line, checks the config once, and runs it.
"""

from __future__ import annotations

if __name__ == "__main__" and __package__ in (None, ""):
    # ``python runner/sweep.py`` puts runner/ on sys.path, not the repository root: fix that, then
    # run the module under its real name (Ray pickles the worker class by module path).
    import sys as _sys
    from pathlib import Path as _Path

    _root = str(_Path(__file__).resolve().parent.parent)
    _here = str(_Path(__file__).resolve().parent)
    _sys.path[:] = [p for p in _sys.path if p != _here]
    if _root not in _sys.path:
        _sys.path.insert(0, _root)
    from kvleague.runner.sweep import main as _main

    raise SystemExit(_main())

import argparse
import json
import os
import sys

from kvleague.engine.errors import KvleagueError
from kvleague.runner.cli_args import OneLineParser
from kvleague.runner.sweep_config import MethodConfig, SweepConfig, clip, load_config

# the sweep's public names, importable from here as before the split
from kvleague.runner.sweeping import CellWorker, SweepRunner, SweepSummary, expand, load_tokenizer, print_summary  # noqa: F401
from kvleague.runner.sweeping.checks import check_config, project_dir

# ------------------------------------------------------------------------------------------------
# Command line (shared by ``python runner/sweep.py`` and ``kvleague sweep``)
# ------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="sweep YAML (see sweeps/demo.yaml)")
    p.add_argument("--db", default=None, help="database URL (overrides the config's database)")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else a local Ray on 127.0.0.1)")
    p.add_argument("--workers", type=int, default=None, help="number of actors (overrides resources.workers)")
    p.add_argument("--limit", type=int, default=None, help="cap every task's sample limit (quick runs)")
    p.add_argument(
        "--methods",
        action="extend",
        default=[],
        type=lambda text: [name for name in text.split(",") if name],
        metavar="NAME[,NAME]",
        help="run only these methods' cells under the config's models, tasks, protocol and generation settings "
        "(a name the config lacks runs at its defaults; the config's full cache stays, done cells are skipped)",
    )
    p.add_argument("--retry-failed", action="store_true", help="run cells stored as failed again")
    p.add_argument("--dry-run", action="store_true", help="validate and count cells; run nothing, write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar; a heartbeat line every 60 s instead")
    p.add_argument("--inject-failure", action="append", default=[], metavar="JSON", help=argparse.SUPPRESS)


def only_methods(config: SweepConfig, names: list[str]) -> SweepConfig:
    """``config`` with only ``names`` as its methods (issue 50: a new method beside a finished sweep): a
    name's entry as the config has it (its params and grid), else the method at its defaults; the
    config's ``full`` stays, the reference every comparison pairs with, so the new cells have their
    partner; cells already in the database are skipped, as on any re-run."""
    entries = {m.name: m for m in config.methods}
    names = list(dict.fromkeys(["full", *names] if "full" in entries else names))
    return config.model_copy(update={"methods": [entries.get(n) or MethodConfig(name=n) for n in names]})


def run_from_args(args: argparse.Namespace) -> int:
    from kvleague.db.session import parse_url

    base = project_dir()
    if args.workers is not None and args.workers < 1:
        raise KvleagueError(f"--workers: must be >= 1, got {args.workers}")
    if args.limit is not None and args.limit < 1:
        raise KvleagueError(f"--limit: must be >= 1, got {args.limit}")
    config = load_config(args.config)
    if args.methods:
        config = only_methods(config, args.methods)
    if args.limit is not None:
        for t in config.tasks:
            t.limit = min(t.limit, args.limit) if t.limit else args.limit
    if args.db:
        parse_url(args.db, base)
    try:
        check_config(config, base)
    except KvleagueError as exc:
        raise KvleagueError(clip(f"config {args.config}: {exc}")) from None
    injections = []
    for text in args.inject_failure:
        try:
            rule = json.loads(text)
        except ValueError:
            raise KvleagueError(f"--inject-failure: not JSON: {text!r}") from None
        if not isinstance(rule, dict):
            raise KvleagueError("--inject-failure: expected a JSON object of cell fields")
        injections.append(rule)
    if args.dry_run:
        grid = expand(config, base)
        for w in grid.warnings:
            print(f"warning: {w}", file=sys.stderr)
        print(f"sweep {config.name}: {len(grid.cells)} cells (dry run; nothing written)")
        return 0
    runner = SweepRunner(
        config,
        db_url=args.db,
        config_path=str(args.config),
        ray_address=args.address,
        retry_failed=args.retry_failed,
        inject_failures=injections,
        progress=not args.no_progress,
        base_dir=base,
        workers=args.workers,
    )
    summary = runner.run()
    print_summary(summary)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    try:
        return run_from_args(args)
    except KeyboardInterrupt:
        print("kvleague: interrupted; finished cells are saved, run the same command again to resume", file=sys.stderr)
        return 130


def register(subparsers) -> None:
    """``kvleague sweep``: this command line, as a subcommand."""
    p = subparsers.add_parser("sweep", help="run a sweep on Ray (results go to the database)")
    add_arguments(p)
    p.set_defaults(func=cmd_sweep)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = OneLineParser(prog="runner/sweep.py", description="Run a kvleague sweep on Ray; results go to SQL.")
    add_arguments(parser)
    try:
        return cmd_sweep(parser.parse_args(argv))
    except KvleagueError as exc:
        print(f"kvleague: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
