"""``kvleague db upgrade|status|export|import`` (one of ``kvleague.cli.COMMAND_GROUPS``)."""

from __future__ import annotations

DB_HELP = "database URL (default: $KVLEAGUE_DB, else sqlite:///kvleague.db)"


def cmd_db_upgrade(args) -> int:
    from kvleague.db.session import display_url, get_engine, upgrade

    engine = get_engine(args.db)
    revision = upgrade(engine)
    print(f"{display_url(engine.url)}: schema at revision {revision}")
    return 0


def cmd_db_status(args) -> int:
    from kvleague.db import store
    from kvleague.db.session import check_connection, current_revision, display_url, get_engine, head_revision

    engine = get_engine(args.db)
    check_connection(engine)
    current = current_revision(engine)
    head = head_revision()
    state = "up to date" if current == head else f"behind (head is {head}; run: kvleague db upgrade)"
    print(f"{display_url(engine.url)}: revision {current or 'none'}, {state}")
    if current == head:
        print(f"sample results: {store.count_results(engine)} ({store.count_results(engine, status='failed')} failed)")
    return 0


def _summary(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counts.items() if n) or "nothing"


def cmd_db_export(args) -> int:
    from pathlib import Path

    from kvleague.db.session import check_connection, display_url, get_engine
    from kvleague.db.transfer import export
    from kvleague.engine.errors import KvleagueError

    if not args.out.endswith(".jsonl.gz"):
        raise KvleagueError(f"--out: an export file ends in .jsonl.gz, got {args.out!r}")
    if not Path(args.out).resolve().parent.is_dir():
        raise KvleagueError(f"--out: directory {str(Path(args.out).resolve().parent)!r} does not exist")
    engine = get_engine(args.db)
    check_connection(engine)
    counts = export(engine, args.out)
    size = Path(args.out).stat().st_size
    print(f"{display_url(engine.url)} -> {args.out} ({size / 1e6:.2f} MB): {_summary(counts.written)}")
    return 0


def cmd_db_import(args) -> int:
    from kvleague.db.session import display_url, get_engine
    from kvleague.db.transfer import import_

    engine = get_engine(args.db)
    counts = import_(engine, args.file)
    print(
        f"{args.file} -> {display_url(engine.url)}: inserted {_summary(counts.inserted)}; "
        f"already there {_summary(counts.present)}"
    )
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("db", help="database: upgrade, status, export, import")
    sub = p.add_subparsers(dest="db_command", required=True)
    up = sub.add_parser("upgrade", help="apply the Alembic migrations up to head (idempotent)")
    up.add_argument("--db", default=None, help=DB_HELP)
    up.set_defaults(func=cmd_db_upgrade)
    st = sub.add_parser("status", help="schema revision and result counts")
    st.add_argument("--db", default=None, help=DB_HELP)
    st.set_defaults(func=cmd_db_status)
    ex = sub.add_parser("export", help="write every table to one reproducible .jsonl.gz file")
    ex.add_argument("--db", default=None, help=DB_HELP)
    ex.add_argument("--out", required=True, help="the export file to write (NAME.jsonl.gz)")
    ex.set_defaults(func=cmd_db_export)
    im = sub.add_parser("import", help="merge an export into a database (nothing already there is duplicated)")
    im.add_argument("file", help="an export written by kvleague db export")
    im.add_argument("--db", default=None, help=DB_HELP)
    im.set_defaults(func=cmd_db_import)
