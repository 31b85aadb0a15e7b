"""``kvleague sweep`` and ``kvleague db upgrade|status`` (added to the CLI through ``_COMMAND_MODULES``)."""

from __future__ import annotations


def cmd_sweep(args) -> int:
    import sys

    from runner.sweep import run_from_args

    try:
        return run_from_args(args)
    except KeyboardInterrupt:
        print("kvleague: interrupted; finished cells are saved, run the same command again to resume", file=sys.stderr)
        return 130


def cmd_db_upgrade(args) -> int:
    from db.session import display_url, get_engine, upgrade

    engine = get_engine(args.db)
    revision = upgrade(engine)
    print(f"{display_url(engine.url)}: schema at revision {revision}")
    return 0


def cmd_db_status(args) -> int:
    from db import store
    from db.session import check_connection, current_revision, display_url, get_engine, head_revision

    engine = get_engine(args.db)
    check_connection(engine)
    current = current_revision(engine)
    head = head_revision()
    state = "up to date" if current == head else f"behind (head is {head}; run: kvleague db upgrade)"
    print(f"{display_url(engine.url)}: revision {current or 'none'}, {state}")
    if current == head:
        print(f"sample results: {store.count_results(engine)} ({store.count_results(engine, status='failed')} failed)")
    return 0


def register(subparsers) -> None:
    from runner.sweep import add_arguments

    p = subparsers.add_parser("sweep", help="run a sweep on Ray (results go to the database)")
    add_arguments(p)
    p.set_defaults(func=cmd_sweep)

    p = subparsers.add_parser("db", help="database schema: upgrade, status")
    sub = p.add_subparsers(dest="db_command", required=True)
    up = sub.add_parser("upgrade", help="apply the Alembic migrations up to head (idempotent)")
    up.add_argument("--db", default=None, help="database URL (default: $KVLEAGUE_DB, else sqlite:///kvleague.db)")
    up.set_defaults(func=cmd_db_upgrade)
    st = sub.add_parser("status", help="schema revision and result counts")
    st.add_argument("--db", default=None, help="database URL (default: $KVLEAGUE_DB, else sqlite:///kvleague.db)")
    st.set_defaults(func=cmd_db_status)
