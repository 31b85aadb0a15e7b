"""The ``kvleague`` command line. Bad input exits with code 2 and one line on stderr.

One module per command group, each with ``register(subparsers)``; this file only puts them together.
"""

from __future__ import annotations

import errno
import os
import sys

from kvleague.dashboard import commands as dashboard_commands
from kvleague.db import commands as db_commands
from kvleague.engine.errors import KvleagueError
from kvleague.runner import bench_commands, fidelity_commands, generate_commands, sweep, task_commands
from kvleague.runner.cli_args import OneLineParser, add_protocol_arguments, protocol_from_args  # noqa: F401 - importable from here
from kvleague.runner.signals import commands as signals_commands

#: the command groups, in the order ``kvleague --help`` lists them
COMMAND_GROUPS = (
    generate_commands,
    task_commands,
    sweep,
    db_commands,
    dashboard_commands,
    bench_commands,
    fidelity_commands,
    signals_commands,
)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="kvleague", description="Benchmark KV-cache eviction methods.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for group in COMMAND_GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KvleagueError as exc:
        print(f"kvleague: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file (an export, a report) on a full or read-only disk
        if exc.errno not in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
            raise
        print(f"kvleague: error: {exc.filename or 'writing'}: {exc.strerror}", file=sys.stderr)
        return 2
    except Exception as exc:  # a database full, read-only or unopenable is one line wherever it surfaces
        from kvleague.db.session import storage_fault

        reason = storage_fault(exc)
        if reason is None:
            raise
        print(f"kvleague: error: database: {reason}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
