"""Options every benchmark shares, and what happens to a finished report (print, JSON, database)."""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from kvleague.engine.errors import KvleagueError


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="checkpoint directory or HF id (default: a 41M-parameter random-weight llama built offline)"
    )
    p.add_argument("--quick", action="store_true", help="a smaller run (a few minutes on 2 CPU cores)")
    p.add_argument("--json", metavar="OUT", help="write the report (figures + environment) here")
    p.add_argument("--store", action="store_true", help="write the figures into the results database")
    p.add_argument(
        "--db", metavar="URL", help="database URL for --store (default: $KVLEAGUE_DB or sqlite:///kvleague.db)"
    )


def add_backend(p: argparse.ArgumentParser) -> None:
    """``--backend NAME`` (repeatable): the engine backends a benchmark runs, side by side in one run."""
    from kvleague.engine import BACKENDS

    p.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        help=f"engine backend ({', '.join(BACKENDS)}; default hf); repeat it to run each in turn in one run, "
        "every figure tagged with its backend, and report the later backends' tokens/s over the first's",
    )


def common_parser(doc: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    add_common(parser)
    return parser


def run_script(module: ModuleType, argv: list[str] | None = None) -> dict:
    """``python -m runner.bench.NAME``: the options and report handling of ``kvleague bench``, for a
    module with ``add_arguments(parser)`` and ``run(args) -> report``."""
    parser = common_parser(module.__doc__)
    module.add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return finish(module.run(args), args)


def finish(report: dict, args) -> dict:
    from kvleague.runner.bench.harness import write_report

    if getattr(args, "json", None):
        path = write_report(report, args.json)
        print(f"\nwrote {path}")
    if getattr(args, "store", False):
        from kvleague.runner.bench.storage import store_report

        try:
            n = store_report(report, args.db)
        except KvleagueError:
            raise
        from kvleague.db.session import default_url, display_url

        print(f"stored {n} figures (run {report['run_id'][:12]}) in {display_url(args.db or default_url())}")
    return report
