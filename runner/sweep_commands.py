"""``kvleague sweep`` (added to the CLI through ``_COMMAND_MODULES``)."""

from __future__ import annotations


def cmd_sweep(args) -> int:
    import sys

    from runner.sweep import run_from_args

    try:
        return run_from_args(args)
    except KeyboardInterrupt:
        print("kvleague: interrupted; finished cells are saved, run the same command again to resume", file=sys.stderr)
        return 130


def register(subparsers) -> None:
    from runner.sweep import add_arguments

    p = subparsers.add_parser("sweep", help="run a sweep on Ray (results go to the database)")
    add_arguments(p)
    p.set_defaults(func=cmd_sweep)

