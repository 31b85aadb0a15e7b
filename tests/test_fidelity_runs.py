"""A paired fidelity comparison says how many runs its rows come from (issue 46: "a pair's two rows
come from the same run, or the report says which"): the oracle is the sweep each row was written
under, here chosen by hand."""

from __future__ import annotations

from kvleague.analysis import fidelity_tables
from kvleague.analysis import queries as q
from kvleague.db.seed import Seeder
from kvleague.db.session import get_engine


def test_a_pair_counts_the_runs_its_rows_come_from(tmp_path):
    engine = get_engine(f"sqlite:///{tmp_path / 'runs.db'}")
    s = Seeder(engine)
    model, proto, gen = s.model("tiny-test"), s.protocol(), s.generation(0.0, max_new_tokens=24)
    first, resumed = s.sweep("first"), s.sweep("resumed")
    task = s.task("math500", "math")
    rows = []
    for method in ("full", "epikv", "h2o", "snapkv"):
        for i in range(12):
            # snapkv's last sample was stored by the resumed run; the others all by the first
            sweep = resumed if (method, i) == ("snapkv", 11) else first
            rows.append(
                {
                    "sweep_id": sweep,
                    "model_id": model,
                    "method_spec_id": s.method(method),
                    "task_id": task,
                    "protocol_id": proto,
                    "generation_id": gen,
                    "budget": 64,
                    "sample_id": f"math500-{i:03d}",
                    "sample_index": 0,
                    "seed": 0,
                    "measure": "fidelity",
                    "kl_mean": 0.0 if method == "full" else 0.01 * (1 + i % 5) * (2 if method == "h2o" else 1),
                    "top1_agreement": 1.0,
                    "delta_nll_mean": 0.0,
                    "scored_tokens": 24,
                    "evictions": 0 if method == "full" else 3,
                }
            )
    s.write(rows)
    pairs = fidelity_tables.fidelity_pairs(engine, q.Filters(), 64)
    runs = {frozenset((r["A"], r["B"])): r["runs"] for _, r in pairs.iterrows()}
    assert runs[frozenset(("epikv", "h2o"))] == 1
    assert runs[frozenset(("epikv", "snapkv"))] == 2
    assert runs[frozenset(("h2o", "snapkv"))] == 2
    engine.dispose()
