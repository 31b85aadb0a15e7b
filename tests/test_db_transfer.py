"""``kvleague db export`` / ``import``: a database survives the round trip row for row (checked by
joining every result to its dimensions, not by ids), merges without duplicates, and the export is
reproducible byte for byte."""

from __future__ import annotations

import gzip
import json
from datetime import datetime, timezone

import pytest
from sqlalchemy import MetaData, Table, insert, text

from kvleague.cli import main
from kvleague.db.seed import RealisticSpec, Seeder, realistic_rows
from kvleague.db.session import get_engine, upgrade
from kvleague.db.transfer import export, import_
from kvleague.engine.errors import KvleagueError

SMALL = RealisticSpec(
    tasks=(("math500", "math", 12, 0.7, 300), ("niah", "longqa", 8, 0.9, 40)),
    budgets=(128, 256),
    methods=("full", "epikv", "h2o"),
    completion_chars=40,
    fail_rate=0.05,
)

# every result with its dimensions spelled out: equal across databases whatever the ids
CONTENT = """
SELECT r.cell_key, r.status, r.correct, r.score, r.completion, r.budget, r.sample_id, r.seed, r.error,
       r.kl_mean, r.top1_agreement, m.name, m.params_json, t.name, t.domain, mo.name, p.recent, g.max_new_tokens,
       s.name, s.config_hash, e.spec_hash
FROM sample_results r JOIN method_specs m ON r.method_spec_id = m.id JOIN tasks t ON r.task_id = t.id
JOIN models mo ON r.model_id = mo.id JOIN protocols p ON r.protocol_id = p.id
JOIN generation_settings g ON r.generation_id = g.id JOIN sweeps s ON r.sweep_id = s.id
LEFT JOIN environments e ON r.environment_id = e.id
"""


def content(engine) -> list[tuple]:
    with engine.connect() as conn:
        return sorted(tuple(row) for row in conn.execute(text(CONTENT)))


def seeded(url: str, spec: RealisticSpec = SMALL):
    engine = get_engine(url)
    s = Seeder(engine)
    s.write(realistic_rows(s, spec))
    with engine.begin() as conn:  # a few fidelity values, so nullable floats travel too
        conn.execute(text("UPDATE sample_results SET kl_mean = 0.125, top1_agreement = 0.75 WHERE budget = 128"))
    return engine


def test_round_trip_keeps_every_row_and_merging_twice_duplicates_nothing(tmp_path, db_url):
    source = seeded(f"sqlite:///{tmp_path / 'source.db'}")
    expected = content(source)
    assert len(expected) == 2 * 3 * (12 + 8) and any(r[1] == "failed" for r in expected)
    path = tmp_path / "results.jsonl.gz"
    written = export(source, path).written
    assert written["sample_results"] == len(expected)

    target = get_engine(db_url)
    first = import_(target, path)
    assert first.inserted["sample_results"] == len(expected) and not first.present.get("sample_results")
    assert content(target) == expected
    second = import_(target, path)
    assert not any(second.inserted.values())
    assert second.present["sample_results"] == len(expected) and second.present["sweeps"] == 1
    assert content(target) == expected


def test_merging_into_a_database_with_results_of_its_own(tmp_path):
    a = seeded(f"sqlite:///{tmp_path / 'a.db'}")
    other = RealisticSpec(
        tasks=SMALL.tasks, budgets=(512,), methods=("full", "snapkv"), sweep="other", completion_chars=40
    )
    b = seeded(f"sqlite:///{tmp_path / 'b.db'}", other)
    path = tmp_path / "a.jsonl.gz"
    export(a, path)
    counts = import_(b, path)
    merged = content(b)
    assert merged == sorted(content(a) + content(seeded(f"sqlite:///{tmp_path / 'b2.db'}", other)))
    # shared dimensions (the model, the full method, the tasks) were found, not inserted again
    assert counts.present["models"] == 1 and counts.present["tasks"] == 2 and counts.present["method_specs"] == 1
    with b.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM method_specs")).scalar() == 4  # full, snapkv, epikv, h2o


def test_export_is_reproducible_byte_for_byte(tmp_path):
    source = seeded(f"sqlite:///{tmp_path / 'source.db'}")
    export(source, tmp_path / "one.jsonl.gz")
    export(source, tmp_path / "two.jsonl.gz")
    assert (tmp_path / "one.jsonl.gz").read_bytes() == (tmp_path / "two.jsonl.gz").read_bytes()
    # a fresh copy made by import exports the same bytes: nothing is lost or reordered on the way
    copy = get_engine(f"sqlite:///{tmp_path / 'copy.db'}")
    import_(copy, tmp_path / "one.jsonl.gz")
    export(copy, tmp_path / "three.jsonl.gz")
    assert (tmp_path / "three.jsonl.gz").read_bytes() == (tmp_path / "one.jsonl.gz").read_bytes()


def test_an_export_of_an_older_schema_imports_at_head(tmp_path):
    old = get_engine(f"sqlite:///{tmp_path / 'old.db'}")
    upgrade(old, "0003")  # before the fidelity columns
    s = Seeder(old, migrate=False)
    rows = list(realistic_rows(s, SMALL))
    reflected = Table("sample_results", MetaData(), autoload_with=old)
    assert "kl_mean" not in reflected.columns
    now = datetime.now(timezone.utc)
    with old.begin() as conn:  # written as the code of that revision would: only the columns it has
        conn.execute(
            insert(reflected),
            [
                {
                    **{c.name: row.get(c.name) for c in reflected.columns if c.name != "id"},
                    "created_at": now,
                    "attempts": 1,
                    "cell_key": f"{row['method_spec_id']}-{row['task_id']}-{row['budget']}-{row['sample_id']}",
                }
                for row in rows
            ],
        )
    path = tmp_path / "old.jsonl.gz"
    export(old, path)
    with gzip.open(path, "rt") as fh:
        assert json.loads(fh.readline())["schema_revision"] == "0003"
    target = get_engine(f"sqlite:///{tmp_path / 'new.db'}")
    import_(target, path)
    got = content(target)
    assert len(got) == len(rows) and all(r[9] is None and r[10] is None for r in got)
    assert sorted(r[2] for r in got if r[2] is not None) == sorted(r["correct"] for r in rows if r["status"] == "ok")


def test_bad_files_are_one_line_errors(tmp_path, capsys):
    target = f"sqlite:///{tmp_path / 't.db'}"
    assert main(["db", "import", str(tmp_path / "missing.jsonl.gz"), "--db", target]) == 2
    (tmp_path / "plain.jsonl.gz").write_text("not gzip")
    assert main(["db", "import", str(tmp_path / "plain.jsonl.gz"), "--db", target]) == 2
    with gzip.open(tmp_path / "future.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"format": "kvleague-export/1", "schema_revision": "9999", "columns": {}}) + "\n")
    assert main(["db", "import", str(tmp_path / "future.jsonl.gz"), "--db", target]) == 2
    assert main(["db", "export", "--db", target, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("kvleague: error: db ") or "--out" in line for line in err)
    assert "missing.jsonl.gz" in err[0] and "not a kvleague export" in err[1] and "9999" in err[2]
    with pytest.raises(KvleagueError, match="not in the header"):
        with gzip.open(tmp_path / "odd.jsonl.gz", "wt") as fh:
            fh.write(json.dumps({"format": "kvleague-export/1", "schema_revision": "0004", "columns": {}}) + "\n")
            fh.write(json.dumps(["secrets", [1]]) + "\n")
        import_(get_engine(target), tmp_path / "odd.jsonl.gz")


def test_cli_export_then_import(tmp_path, capsys):
    seeded(f"sqlite:///{tmp_path / 'source.db'}")
    out = tmp_path / "r.jsonl.gz"
    assert main(["db", "export", "--db", f"sqlite:///{tmp_path / 'source.db'}", "--out", str(out)]) == 0
    assert main(["db", "import", str(out), "--db", f"sqlite:///{tmp_path / 'copy.db'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "sample_results 120" in lines[0] and "inserted" in lines[1] and "sample_results 120" in lines[1]


def test_a_sweep_exported_while_running_and_again_after_is_one_sweep(tmp_path):
    from kvleague.db import store

    source = seeded(f"sqlite:///{tmp_path / 'source.db'}")
    with source.begin() as conn:
        conn.execute(text("UPDATE sweeps SET status = 'running', n_ok = 3"))
    target = get_engine(f"sqlite:///{tmp_path / 'target.db'}")
    export(source, tmp_path / "during.jsonl.gz")
    import_(target, tmp_path / "during.jsonl.gz")
    with source.begin() as conn:
        sweep_id = conn.execute(text("SELECT id FROM sweeps")).scalar_one()
    store.finish_sweep(source, sweep_id, "finished")
    export(source, tmp_path / "after.jsonl.gz")
    counts = import_(target, tmp_path / "after.jsonl.gz")
    assert counts.present["sweeps"] == 1 and not counts.inserted.get("sweeps")
    with target.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sweeps")).scalar() == 1
    assert content(target) == content(source)


def test_the_one_spec_hash_reproduces_every_hash_in_the_committed_results():
    """db.spec_hash is the one hash; the hashes the results export was written with (by the code
    before it) are reproduced from the stored rows: dimension rows (compact JSON), environments and
    sweep config hashes (json.dumps's default separators), so db import keeps matching them."""
    from pathlib import Path

    from kvleague.db.spec_hash import spec_hash
    from kvleague.runner.provenance import environment_hash
    from kvleague.runner.sweep_config import UNHASHED_FIELDS, SweepConfig

    path = Path(__file__).resolve().parent.parent / "results" / "replication.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        columns = json.loads(fh.readline())["columns"]
        rows = [json.loads(line) for line in fh]
    by_table: dict[str, list[dict]] = {}
    for table, values in rows:
        by_table.setdefault(table, []).append(dict(zip(columns[table], values)))
    spec = {
        "models": lambda r: {k: r[k] for k in ("source", "dtype", "attn_implementation")},
        "method_specs": lambda r: {"name": r["name"], "params": r["params"]},
        "generation_settings": lambda r: {k: r[k] for k in ("max_new_tokens", "temperature", "top_p", "stop")},
        # preset fields at their defaults are left out of a protocol's spec (stored as NULL)
        "protocols": lambda r: {
            k: v
            for k, v in r.items()
            if k not in ("id", "spec_hash")
            and not (k in ("recent_max_fraction", "prompt_over_budget", "budget_base") and v is None)
        },
    }
    checked = 0
    for table, of in spec.items():
        for r in by_table[table]:
            assert spec_hash(of(r)) == r["spec_hash"], (table, r)
            checked += 1
    for r in by_table["environments"]:
        assert environment_hash({k: v for k, v in r.items() if k not in ("id", "created_at")}) == r["spec_hash"], r
        checked += 1
    for r in by_table["sweeps"]:  # the config as stored (from the config model of its day), unhashed fields left out
        assert (
            spec_hash({k: v for k, v in r["config"].items() if k not in UNHASHED_FIELDS}, spaced=True)
            == r["config_hash"]
        ), r["id"]
        checked += 1
    fields = set(SweepConfig.model_fields)  # unhashed fields added since (batch_size) may be absent
    current = [r for r in by_table["sweeps"] if fields - set(UNHASHED_FIELDS) <= set(r["config"]) <= fields]
    assert current  # sweeps written by today's config model: SweepConfig.config_hash gives their stored hash
    for r in current:
        assert SweepConfig.model_validate(r["config"]).config_hash() == r["config_hash"], r["id"]
    assert checked > 20


@pytest.mark.parametrize("cut", ["middle", "header"])
def test_a_truncated_export_is_one_line_and_creates_nothing(tmp_path, cut):
    """The committed export cut short (as an interrupted download leaves it): one line naming the file,
    exit 2 from the console script, and no database file behind (not even an empty schema)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    whole = (REPO / "results" / "replication.jsonl.gz").read_bytes()
    cut_file = tmp_path / "cut.jsonl.gz"
    cut_file.write_bytes(whole[: len(whole) // 2] if cut == "middle" else whole[:40])
    target = tmp_path / "t.db"
    proc = subprocess.run(
        [sys.executable, "-m", "kvleague.cli", "db", "import", str(cut_file), "--db", f"sqlite:///{target}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"kvleague: error: db import: {str(cut_file)!r} is truncated"), proc.stderr
    assert not target.exists()
