"""The store under hostile input (issue 45): every row is validated against the schema before it is
stored, by the sweep writer and by ``kvleague db import`` alike; a refused import is one line naming the
line and the field, exit 2, and creates no file; text with NUL stores and reads back identical on SQLite
and PostgreSQL, and an export moves between them."""

from __future__ import annotations

import gzip
import json
import math
import tracemalloc
import zlib
from pathlib import Path

import pytest
from sqlalchemy import select, text

from kvleague.cli import main
from kvleague.db.models import ESC, SampleResult
from kvleague.db.seed import RealisticSpec, Seeder, realistic_rows
from kvleague.db.session import get_engine
from kvleague.db.transfer import export, import_
from kvleague.runner.sweeping.writer import ResultWriter

TINY = RealisticSpec(tasks=(("math500", "math", 3, 0.7, 300),), budgets=(128,), methods=("full", "h2o"), fail_rate=0.0)
HOSTILE_TEXT = "answer\x00 is 4 \x00\x00" + ESC + "0" + ESC + ESC + " ![x](http://attacker/x.png) <img src=x>"


@pytest.fixture(scope="module")
def export_lines(tmp_path_factory) -> tuple[dict, list[list]]:
    """A small, valid export: its header and its rows (table, values), to be spoiled one field at a time."""
    root = tmp_path_factory.mktemp("export")
    engine = get_engine(f"sqlite:///{root / 'source.db'}")
    s = Seeder(engine)
    s.write(realistic_rows(s, TINY))
    export(engine, root / "x.jsonl.gz")
    with gzip.open(root / "x.jsonl.gz", "rt") as fh:
        header = json.loads(fh.readline())
        return header, [json.loads(line) for line in fh]


def _write(path: Path, header: dict, rows: list[list]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write(json.dumps(header) + "\n")
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


def _set(header, rows, table: str, column: str, value, nth: int = 0) -> tuple[list[list], int]:
    """A copy of ``rows`` with ``column`` of the nth row of ``table`` set to ``value``; and that row's line."""
    index = header["columns"][table].index(column)
    where = [i for i, (t, _) in enumerate(rows) if t == table][nth]
    out = [[t, list(v)] for t, v in rows]
    out[where][1][index] = value
    return out, where + 2  # the header is line 1


SPOILED = {
    "a budget that is text": ("sample_results", "budget", "big", "sample_results.budget"),
    "NaN": ("sample_results", "score", math.nan, "sample_results.score"),
    "Infinity": ("sample_results", "score", math.inf, "sample_results.score"),
    "a boolean that is a number": ("sample_results", "correct", 1, "sample_results.correct"),
    "a bad datetime": ("sample_results", "created_at", "yesterday", "sample_results.created_at"),
    "an int over 64 bits": ("sample_results", "seed", 2**70, "sample_results.seed"),
    "an int over 32 bits in an Integer": (
        "sample_results",
        "generated_tokens",
        2**40,
        "sample_results.generated_tokens",
    ),
    "NaN inside JSON": ("sample_results", "details", {"x": [math.nan]}, "sample_results.details"),
    "NUL in a name": ("method_specs", "name", "h2o\x00", "method_specs.name"),
    "a lone surrogate": ("sample_results", "completion", "\ud800", "sample_results.completion"),
    "a status over its width": ("sample_results", "status", "x" * 17, "sample_results.status"),
    "a missing required value": ("sample_results", "cell_key", None, "sample_results.cell_key"),
}


@pytest.mark.parametrize("case", list(SPOILED))
def test_a_spoiled_field_is_refused_in_one_line_naming_line_and_field(case, export_lines, tmp_path, capsys):
    header, rows = export_lines
    table, column, value, field = SPOILED[case]
    spoiled, line = _set(header, rows, table, column, value)
    path = _write(tmp_path / "bad.jsonl.gz", header, spoiled)
    target = tmp_path / "t.db"
    assert main(["db", "import", str(path), "--db", f"sqlite:///{target}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"line {line}: {field}" in err, err
    assert not target.exists()


def test_shared_ids_unique_keys_and_dangling_references_are_refused(export_lines, tmp_path, capsys):
    """Two method rows with one old id (which re-attributed full's results to the other method), a
    cell_key twice, extra values, a row naming a method that is not in the file."""
    header, rows = export_lines
    methods = [i for i, (t, _) in enumerate(rows) if t == "method_specs"]
    results = [i for i, (t, _) in enumerate(rows) if t == "sample_results"]
    id_col = header["columns"]["method_specs"].index("id")
    key_col = header["columns"]["sample_results"].index("cell_key")
    shared = [[t, list(v)] for t, v in rows]
    shared[methods[1]][1][id_col] = shared[methods[0]][1][id_col]
    twice = [[t, list(v)] for t, v in rows]
    twice[results[1]][1][key_col] = twice[results[0]][1][key_col]
    extra = [[t, list(v)] for t, v in rows]
    extra[results[0]][1].append("dropped?")
    dangling, _ = _set(header, rows, "sample_results", "method_spec_id", 999)
    expected = {
        "shared": (shared, f"line {methods[1] + 2}: method_specs.id"),
        "twice": (twice, f"line {results[1] + 2}: sample_results.cell_key"),
        "extra": (extra, f"line {results[0] + 2}: sample_results row has"),
        "dangling": (dangling, f"line {results[0] + 2}: sample_results.method_spec_id: no method_specs row 999"),
    }
    for name, (spoiled, message) in expected.items():
        target = tmp_path / f"{name}.db"
        path = _write(tmp_path / f"{name}.jsonl.gz", header, spoiled)
        assert main(["db", "import", str(path), "--db", f"sqlite:///{target}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (name, err)
        assert not target.exists()


def test_a_one_gib_line_is_refused_fast_with_bounded_memory(export_lines, tmp_path, capsys):
    """A ~1 MB gzip whose second line is 1 GiB (64 gzip members of 16 MiB each, no newline): refused
    after reading the cap, without holding the line (the old reader took 2.1 GB and 31 s)."""
    from kvleague.db.validation import MAX_LINE_BYTES

    header, _ = export_lines
    member = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = member.compress(b"a" * 2**24) + member.flush()
    path = tmp_path / "long.jsonl.gz"
    with open(path, "wb") as fh:
        fh.write(gzip.compress((json.dumps(header) + "\n").encode()))
        fh.write(block * 64)
    assert path.stat().st_size < 2_000_000
    tracemalloc.start()
    try:
        assert main(["db", "import", str(path), "--db", f"sqlite:///{tmp_path / 't.db'}"]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2 is longer than" in err, err
    assert peak < 4 * MAX_LINE_BYTES  # the cap, not the line
    assert not (tmp_path / "t.db").exists()


def _nul_row(s: Seeder, key: str) -> dict:
    row = next(iter(realistic_rows(s, TINY)))
    return {
        **row,
        "cell_key": key,
        "completion": HOSTILE_TEXT,
        "extracted": "\x00",
        "sample_id": "s\x00" + ESC,
        "details": {"answers": [HOSTILE_TEXT]},
    }


def test_nul_stores_and_reads_back_identical_and_the_export_moves_between_backends(db_url, tmp_path):
    """A completion with NUL through the sweep writer: stored and read back as written on each backend
    (PostgreSQL refused the whole batch, forever); a SQLite database's export imports into this one."""
    engine = get_engine(db_url)
    s = Seeder(engine)
    writer = ResultWriter(engine, type("R", (), {"batch_size": 1, "flush_seconds": 0, "db_retry_seconds": 5})())
    writer.add(_nul_row(s, "nul-1"))
    writer.flush(force=True)
    table = SampleResult.__table__
    with engine.connect() as conn:
        got = conn.execute(
            select(table.c.completion, table.c.extracted, table.c.sample_id, table.c.details).where(
                table.c.cell_key == "nul-1"
            )
        ).one()
    assert tuple(got) == (HOSTILE_TEXT, "\x00", "s\x00" + ESC, {"answers": [HOSTILE_TEXT]})

    source = get_engine(f"sqlite:///{tmp_path / 'source.db'}")
    ss = Seeder(source)
    src_writer = ResultWriter(source, writer.res)
    src_writer.add(_nul_row(ss, "nul-2"))
    src_writer.flush(force=True)
    export(source, tmp_path / "nul.jsonl.gz")
    import_(engine, tmp_path / "nul.jsonl.gz")
    with engine.connect() as conn:
        moved = conn.execute(select(table.c.completion).where(table.c.cell_key == "nul-2")).scalar_one()
        raw = conn.execute(text("SELECT completion FROM sample_results WHERE cell_key = 'nul-2'")).scalar_one()
    assert moved == HOSTILE_TEXT and "\x00" not in raw
    export(engine, tmp_path / "back.jsonl.gz")  # and back out of it, the same text
    with gzip.open(tmp_path / "back.jsonl.gz", "rt") as fh:
        assert json.dumps(HOSTILE_TEXT, ensure_ascii=False) in fh.read()


def test_a_result_that_may_not_be_stored_becomes_a_failed_row_naming_the_field(tmp_path, capsys):
    """The writer validates as the importer does: a NaN score is not stored as NULL (SQLite) nor NaN
    (PostgreSQL) but as a failed cell saying why, and the sweep goes on."""
    engine = get_engine(f"sqlite:///{tmp_path / 'r.db'}")
    s = Seeder(engine)
    writer = ResultWriter(engine, type("R", (), {"batch_size": 1, "flush_seconds": 0, "db_retry_seconds": 5})())
    writer.add({**_nul_row(s, "nan"), "score": math.nan, "status": "ok"})
    writer.add({**_nul_row(s, "fine"), "completion": "ok"})
    writer.flush(force=True)
    with engine.connect() as conn:
        rows = dict(
            conn.execute(text("SELECT cell_key, status || ':' || coalesce(error, '') FROM sample_results")).all()
        )
    assert rows["fine"] == "ok:"
    assert rows["nan"].startswith("failed:result not stored: sample_results.score: NaN")
    assert "cell nan: result not stored: sample_results.score" in capsys.readouterr().err
