"""The preamble's counts (``analysis.preamble``): each placeholder gives the count of the rows a hand-made
database holds, recounted here from the rows as written; a typo is one line and exit 2, never a 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvleague.analysis import queries as q
from kvleague.analysis.preamble import resolve
from kvleague.analysis.report import totals
from kvleague.cli import main
from kvleague.db import store
from kvleague.db.models import SignalCorrelation, TaskSpec
from kvleague.db.seed import Seeder
from kvleague.db.session import get_engine

ROWS: list[dict] = []


def _task(s: Seeder, name: str, domain: str, options: dict) -> int:
    """A task row with ``options`` (the seeder's have none): ``fidelity_reference`` changes the reference,
    not the prompt, so its samples are the same prompts as the plain row's."""
    spec = {"name": name, "domain": domain, "options": options, "dataset": name, "source": None, "revision": None}
    return store.get_or_create(
        s.engine, TaskSpec, {**spec, "spec_hash": f"{name}-{options}", "scorer_version": "1", "metric": "accuracy"}
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('preamble') / 'p.db'}"
    s = Seeder(get_engine(url))
    model, greedy = s.model("tiny"), s.generation(0.0)
    p1, p2 = s.protocol(sink=4, recent=8), s.protocol(sink=0, recent=16, positions="compact")
    alpha, beta = s.sweep("alpha"), s.sweep("beta")
    math, code = s.task("math500", "math"), s.task("humaneval", "code")
    math_self = _task(s, "math500", "math", {"fidelity_reference": "self"})
    full, h2o = s.method("full"), s.method("h2o")

    def row(sweep, proto, task, method, budget, i, **extra):
        ROWS.append(
            {
                "sweep": sweep,
                "protocol": proto,
                "task": task,
                "method": method,
                "budget": budget,
                "sample": f"s{i}",
                "status": extra.get("status", "ok"),
                "prompt_tokens": extra.get("prompt_tokens"),
                "wall_seconds": extra.get("wall_seconds"),
            }
        )
        return {
            "sweep_id": sweep,
            "model_id": model,
            "method_spec_id": method,
            "task_id": task,
            "protocol_id": proto,
            "generation_id": greedy,
            "budget": budget,
            "sample_id": f"s{i}",
            "sample_index": 0,
            "seed": 0,
            "measure": "fidelity" if proto == p2 else "generation",
            **extra,
        }

    rows = [row(alpha, p1, math, m, b, i) for m in (full, h2o) for b in (64, 128) for i in range(5)]
    rows.append(row(alpha, p1, math, h2o, 64, 5, status="failed"))
    rows += [row(beta, p2, code, h2o, 64, i, prompt_tokens=100 + i, wall_seconds=2.0**i) for i in range(3)]
    rows += [row(beta, p2, math_self, h2o, 64, i, prompt_tokens=200) for i in range(2, 9)]  # s2-s4 again
    s.write(rows)
    with s.engine.begin() as conn:
        conn.execute(
            SignalCorrelation.__table__.insert(),
            [
                {
                    **dict(zip(("run_id", "occluded", "n_samples"), run)),
                    "row_key": run[0],
                    "model": "tiny",
                    "task": "math500",
                    "domain": "math",
                    "label": "occlusion_nll",
                    "signal": "key_norm_mean",
                    "family": "key_norm_mean",
                    "n_layers": 2,
                    "n_pairs": 10,
                }
                for run in (("r1", "context", 20), ("r2", "trace", 30))
            ],
        )
    ids = {"alpha": alpha, "beta": beta, "p1": p1, "p2": p2, "math": math, "code": code, "self": math_self, "h2o": h2o}
    return s.engine, ids


def _count(**where) -> list[dict]:
    return [r for r in ROWS if all(r[k] in (v if isinstance(v, tuple) else (v,)) for k, v in where.items())]


def test_each_placeholder_counts_what_the_rows_hold(engine):
    eng, ids = engine
    tasks = q.dimensions(eng)["tasks"]
    got = lambda text: resolve(eng, text, tasks)  # noqa: E731
    alpha = _count(sweep=ids["alpha"])
    assert got("{{cells sweep=alpha}}") == str(len(alpha)) == "21"
    assert got("{{failed sweep=alpha}}") == str(sum(r["status"] == "failed" for r in alpha)) == "1"
    assert got("{{failed sweep=beta}}") == "0"  # a selection that matches rows may have no failure
    assert got("{{cells sweep=alpha budget=128 method=h2o}}") == str(len(_count(budget=128, method=ids["h2o"]))) == "5"
    assert got("{{methods sweep=alpha}}") == "2" and got("{{methods sweep=beta}}") == "1"
    assert got("{{budgets sweep=alpha}}") == "64/128"
    # samples are prompts: the fidelity_reference variant's s2-s4 are math500's s2-s4
    math = {r["sample"] for r in _count(task=(ids["math"], ids["self"]))}
    assert got("{{samples task=math500}}") == str(len(math)) == "9"
    assert got("{{samples domain=code,math}}") == str(len(math) + 3)
    assert got("{{samples}}") == str(totals(eng, tasks=tasks)["samples"])  # the report's totals agree
    assert got("{{samples protocol=" + str(ids["p2"]) + " each=task}}") == "3-7"
    assert got("{{cells sweep=alpha each=budget}}") == "10-11"
    assert got("{{cells sweep=alpha method=full each=budget}}") == "5"
    lengths = [r["prompt_tokens"] for r in _count(task=ids["code"])]
    assert got("{{prompt_tokens task=humaneval}}") == str(round(sum(lengths) / len(lengths))) == "101"
    times = sorted(r["wall_seconds"] for r in _count(task=ids["code"]))
    assert got("{{seconds task=humaneval}}") == str(round(times[len(times) // 2])) == "2"
    assert got("{{signal_samples}}") == "20-30" and got("{{signal_samples occluded=trace}}") == "30"
    assert got("a {{cells measure=fidelity}} b {{\n  cells\n  sweep=beta }}") == "a 10 b 10"


@pytest.mark.parametrize(
    ("placeholder", "says"),
    [
        (
            "{{cells tsk=math500}}",
            "unknown key 'tsk'; cells takes sweep, protocol, task, domain, method, measure, budget, each",
        ),
        ("{{cells task=humaneavl}}", "task=humaneavl matches no row; task is one of humaneval, math500"),
        ("{{samples sweep=alpha,gamma}}", "sweep=gamma matches no row; sweep is one of alpha, beta"),
        ("{{cells sweep=alpha task=humaneval}}", "matches no row"),
        ("{{cellz sweep=alpha}}", "the quantity must be one of cells, failed, samples"),
        ("{{cells sweep}}", "'sweep': write KEY=VALUE"),
        ("{{samples each=tsk}}", "each=tsk: unknown key"),
        ("{{seconds sweep=alpha}}", "its rows store no cell time"),
        ("{{signal_samples sweep=alpha}}", "signal_samples takes task, domain, occluded, each"),
    ],
)
def test_a_bad_placeholder_is_one_line_and_exit_2(engine, tmp_path, capsys, placeholder, says):
    eng, _ = engine
    (tmp_path / "p.md").write_text(f"We ran {placeholder} cells.\n")
    out = tmp_path / "out"
    args = ["report", "--db", str(eng.url), "--out", str(out), "--preamble", str(tmp_path / "p.md")]
    assert main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"kvleague: error: preamble: {placeholder}: ") and says in line, line
    assert not Path(out).exists()  # nothing written
