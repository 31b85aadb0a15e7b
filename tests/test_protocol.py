"""The one typed protocol: parsed where it enters, carried as one object, its hashes, rows and labels
derived from its field list; the hashes stored by earlier code reproduce."""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path

import pytest

from kvleague.db.spec_hash import spec_hash
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import Cadence, Protocol

EXPORT = Path(__file__).resolve().parent.parent / "results" / "replication.jsonl.gz"


@pytest.fixture(scope="module")
def stored() -> dict[str, list[dict]]:
    """The committed export's rows by table (written by the code before the typed protocol)."""
    with gzip.open(EXPORT, "rt") as fh:
        columns = json.loads(fh.readline())["columns"]
        rows = [json.loads(line) for line in fh]
    tables: dict[str, list[dict]] = collections.defaultdict(list)
    for table, values in rows:
        tables[table].append(dict(zip(columns[table], values)))
    return tables


def test_stored_protocol_hashes_and_cell_keys_reproduce(stored):
    """Every protocol row read back as a Protocol hashes to its stored spec_hash, and every stored cell
    key is the hash of its cell's spec with that protocol's spec, for a protocol stored before the
    preset fields existed (NULL columns) and for the presets' protocols alike."""
    protocols = {p["id"]: p for p in stored["protocols"]}
    assert any(p["prompt_over_budget"] is None for p in protocols.values())  # the compatibility rule is exercised
    assert any(p["prompt_over_budget"] == "keep" for p in protocols.values())
    for row in protocols.values():
        assert spec_hash(Protocol.from_spec(row).spec()) == row["spec_hash"], row
    by_id = {table: {r["id"]: r for r in rows} for table, rows in stored.items() if table != "sample_results"}
    for r in stored["sample_results"]:
        model, method, task, generation = (
            by_id[t][r[c]]
            for t, c in (
                ("models", "model_id"),
                ("method_specs", "method_spec_id"),
                ("tasks", "task_id"),
                ("generation_settings", "generation_id"),
            )
        )
        spec = {
            "model": {k: model[k] for k in ("source", "dtype", "attn_implementation")},
            "method": method["name"],
            "params": method["params"],
            "budget": r["budget"],
            "task": task["name"],
            "task_options": {
                k: v for k, v in task["options"].items() if k not in ("length_unit", "fidelity_reference")
            },
            "sample_id": r["sample_id"],
            "protocol": Protocol.from_spec(protocols[r["protocol_id"]]).spec(),
            "seed": r["seed"],
        }
        if r["measure"] == "generation":
            spec.update(
                sample_index=r["sample_index"],
                generation={k: generation[k] for k in ("max_new_tokens", "temperature", "top_p", "stop")},
            )
        else:
            spec.update(measure=r["measure"], max_scored_tokens=generation["max_new_tokens"])
            if "fidelity_reference" in task["options"]:  # scored on the model's own trace (a task row of its own)
                spec.update(reference=task["options"]["fidelity_reference"])
        assert spec_hash(spec) == r["cell_key"], r["id"]
    assert len(stored["sample_results"]) > 1000


def test_stored_sweep_configs_give_their_stored_protocols(stored):
    """From the YAML edge to the hash: each stored sweep config (of today's config model) resolves, per
    task, to a Protocol whose spec hash is one of the stored protocol rows."""
    from kvleague.runner.sweep_config import UNHASHED_FIELDS, SweepConfig
    from kvleague.tasks.registry import task_class

    hashes = {p["spec_hash"] for p in stored["protocols"]}
    fields = set(SweepConfig.model_fields)
    checked = 0
    for sweep in stored["sweeps"]:
        if not fields - set(UNHASHED_FIELDS) <= set(sweep["config"]) <= fields:
            continue  # written by an older config model
        config = SweepConfig.model_validate(sweep["config"])
        for entry in config.tasks:
            cls = task_class(entry.name)
            protocol = config.protocol_for(cls.domain, cls.protect_prompt)
            assert isinstance(protocol.cadence, Cadence)
            assert spec_hash(protocol.spec()) in hashes, (sweep["id"], entry.name)
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("text, buffer", [("every_step", 0), ("buffer=1", 1), ("buffer=64", 64)])
def test_cadence_is_parsed_once_and_written_back_as_its_text(text, buffer):
    protocol = Protocol(cadence=text)
    assert protocol.cadence == Cadence(buffer) and protocol.buffer == buffer
    assert protocol.spec()["cadence"] == text and str(protocol.cadence) == text
    assert Protocol(cadence=Cadence(buffer)) == protocol == Protocol.from_spec(protocol.spec())


@pytest.mark.parametrize(
    "values, message",
    [
        ({"cadence": "sometimes"}, "cadence: unknown 'sometimes'; allowed: every_step, buffer=N"),
        ({"cadence": "buffer=0"}, "cadence: 'buffer=0' needs a positive integer N; allowed: every_step, buffer=N"),
        ({"cadence": "buffer=x"}, "cadence: 'buffer=x' needs a positive integer N; allowed: every_step, buffer=N"),
        ({"positions": "relative"}, "positions: Input should be 'absolute' or 'compact' (got 'relative')"),
        ({"sink": -1}, "sink: Input should be greater than or equal to 0 (got -1)"),
        ({"recent_max_fraction": 1.5}, "recent_max_fraction: Input should be less than or equal to 1 (got 1.5)"),
        ({"sinks": 2}, "sinks: unknown protocol field; allowed: cadence, positions, sink, recent, protect_prompt,"),
    ],
)
def test_an_invalid_protocol_is_one_line_naming_the_field(values, message):
    with pytest.raises(KvleagueError) as info:
        Protocol(**values)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_spec_leaves_out_the_fields_added_later_only_at_their_defaults():
    plain = Protocol(sink=4, recent=16)
    assert set(plain.spec()) == {"cadence", "positions", "sink", "recent", "protect_prompt", "prefill_chunk"}
    capped = Protocol(sink=4, recent=16, recent_max_fraction=0.5)
    assert capped.spec()["recent_max_fraction"] == 0.5 and "prompt_over_budget" not in capped.spec()
    assert spec_hash(plain.spec()) != spec_hash(capped.spec())
    # a stored row holds NULL for a field left out: read back, it is the default
    assert (
        Protocol.from_spec(
            {**plain.spec(), "id": 1, "spec_hash": "x", "recent_max_fraction": None, "prompt_over_budget": None}
        )
        == plain
    )


def test_the_protocols_table_and_the_label_follow_the_field_list():
    from kvleague.analysis.queries import PROTOCOL_LABEL_PARTS, protocol_label
    from kvleague.db.models import PROTOCOL_COLUMNS, ProtocolSpec

    assert PROTOCOL_COLUMNS == tuple(Protocol.model_fields) == tuple(PROTOCOL_LABEL_PARTS)
    nullable = {c.name for c in ProtocolSpec.__table__.columns if c.nullable}
    assert nullable == {"prefill_chunk", *Protocol.ADDED_LATER}
    row = {"id": 2, **Protocol.preset("epikv_paper").spec()}
    # the published report's heading of this protocol (docs/replication.md): the window the engine keeps
    assert protocol_label(row) == "#2: every_step, compact, sink 0, recent min(128, B/4), prompt protected"
    assert (
        Protocol.preset("epikv_paper").recent_for(64) == 16 and Protocol.preset("epikv_paper").recent_for(1024) == 128
    )
    assert (
        protocol_label({"id": 5, **Protocol(cadence="buffer=8", prefill_chunk=64).spec()})
        == "#5: buffer=8, absolute, sink 0, recent 0, prompt compressed, prefill chunk 64"
    )


def test_config_checks_each_protocols_budgets_once(tmp_path, monkeypatch):
    """Tasks of one domain share a protocol, and the base protocol is one of them: each (protocol,
    budget) is checked once."""
    from kvleague.runner.sweep_config import parse_config
    from kvleague.runner.sweeping.checks import check_config

    checked: list[tuple[Protocol, int]] = []
    real = Protocol.check_budget
    monkeypatch.setattr(
        Protocol, "check_budget", lambda self, budget: (checked.append((self, budget)), real(self, budget))[1]
    )
    config = parse_config(
        {
            "name": "t",
            "database": f"sqlite:///{tmp_path / 't.db'}",
            "models": [{"source": "x/y"}],
            "methods": ["full"],
            "budgets": [32, 64],
            "tasks": ["math500", "aime25"],
            "protocol": {"sink": 2, "recent": 4, "protect_prompt": False},
        }
    )
    check_config(config, tmp_path)
    assert sorted(b for _, b in checked) == [32, 64] and len({p for p, _ in checked}) == 1
