"""Sweeps decode a cell's samples together (``batch_size``; issue 18): which cells group, and that a
group's rows equal the rows of its cells run one by one (the single path is the oracle)."""

from __future__ import annotations

import pytest

from kvleague.engine.errors import KvleagueError
from kvleague.runner.sweep_config import parse_config
from kvleague.runner.sweeping.cell import CellWorker
from kvleague.runner.sweeping.grid import AUTO_BATCH_LIMIT, QUEUED_BATCHES, batches, expand, spread


def config(model, tmp_path, **over) -> dict:
    return {
        "name": "batching",
        "database": f"sqlite:///{tmp_path / 'b.db'}",
        "models": [{"source": str(model), "dtype": "float32"}],
        "methods": ["full", "h2o", {"name": "streaming_llm", "grid": {"n_sink": [2, 4]}}],
        "budgets": [24],
        "tasks": [{"name": "gsm8k", "limit": 5}, {"name": "kv_agent", "limit": 2, "measure": "both"}],
        "protocol": {"sink": 2, "recent": 4, "protect_prompt": False},
        "generation": {"max_new_tokens": 12},
        **over,
    }


def test_batches_group_a_cells_samples_and_keep_episode_fidelity_alone(tiny_models, tmp_path):
    cells = expand(parse_config(config(tiny_models["llama"], tmp_path))).cells
    groups = batches(cells, 3)
    assert sorted(c.key for g in groups for c in g) == sorted(c.key for c in cells)  # each cell once
    for g in groups:
        # a plain task's generation group queues QUEUED_BATCHES batches (continuous batching)
        assert 1 <= len(g) <= (3 * QUEUED_BATCHES if g[0].task == "gsm8k" and g[0].measure == "generation" else 3)
        if len(g) > 1:  # one task's generation cells under one method spec, budget and seed (episodes too)
            assert {c.measure for c in g} == {"generation"} and len({c.task for c in g}) == 1
            assert len({(c.method, str(c.params), c.budget, c.seed, str(c.protocol)) for c in g}) == 1
            assert len({c.sample_id for c in g}) == len(g)
    # 4 method specs x 5 gsm8k samples: one group each (5 <= 3 x 4); x 2 kv_agent episodes: 1 group each
    assert sum(len(g) == 5 and g[0].task == "gsm8k" for g in groups) == 4
    assert sum(len(g) == 2 and g[0].task == "kv_agent" for g in groups) == 4
    # an episode's fidelity cells (against the reference agent: multi-segment) run alone, in grid order
    fidelity = [g for g in groups if g[0].measure == "fidelity"]
    assert all(len(g) == 1 for g in fidelity)
    assert [g[0].key for g in fidelity] == [c.key for c in cells if c.measure == "fidelity"]
    assert all(len(g) == 1 for g in batches(cells, 1))
    assert max(len(g) for g in batches(cells, "auto")) == min(5, AUTO_BATCH_LIMIT)


def test_queued_groups_split_back_while_workers_would_idle(tiny_models, tmp_path):
    """A plain task's generation groups queue four batches (continuous batching), but a sweep with
    fewer groups than workers splits them back at batch boundaries, so no worker idles; other groups
    (episodes, fidelity) never split, and every cell stays once, in order within its group."""
    cells = [c for c in expand(parse_config(config(tiny_models["llama"], tmp_path))).cells if c.measure == "generation"]
    groups = batches(cells, 2)
    gsm8k = [g for g in groups if g[0].task == "gsm8k"]
    assert [len(g) for g in gsm8k] == [5] * 4  # 5 samples <= 2 x QUEUED_BATCHES
    assert spread(groups, 2, 1) == groups and spread(groups, 2, len(groups)) == groups
    wide = spread(groups, 2, len(groups) + 4)
    assert len(wide) == len(groups) + 4
    assert [c.key for g in wide for c in g] == [c.key for g in groups for c in g]
    split = spread(groups, 2, 10 * len(cells))  # as many workers as wanted: every queued group down to batches
    assert sorted(len(g) for g in split if g[0].task == "gsm8k") == sorted([2, 2, 1] * 4)
    assert [g for g in split if g[0].task != "gsm8k"] == [g for g in groups if g[0].task != "gsm8k"]


def test_batch_size_is_checked_at_the_edge_and_not_hashed(tiny_models, tmp_path):
    base = config(tiny_models["llama"], tmp_path)
    for bad in (0, -1, "big", True, 257):
        with pytest.raises(KvleagueError, match=r"batch_size: got .*; allowed: auto or an integer 1\.\.256"):
            parse_config({**base, "batch_size": bad})
    # how cells are grouped does not change what the sweep computes, so not its hash
    assert parse_config({**base, "batch_size": 4}).config_hash() == parse_config(base).config_hash()


@pytest.mark.parametrize("task,budget", [("gsm8k", 24), ("gsm8k", "prompt+8"), ("kv_agent", 48)])
def test_a_group_decodes_together_and_equals_its_cells_one_by_one(tiny_models, tmp_path, monkeypatch, task, budget):
    """Also with budgets relative to each prompt (``prompt+8``): each sample its own budget, the
    group still one batch (it used to run sample by sample), four rows for five samples (the fifth
    takes the first finished row); and episodes (multi-turn, their decodes batched round by round;
    they used to run one by one)."""
    from kvleague.engine import batch

    cells = expand(
        parse_config(config(tiny_models["llama"], tmp_path, budgets=[budget], tasks=[{"name": task, "limit": 5}]))
    ).cells
    group = next(g for g in batches(cells, 4) if g[0].method == "h2o")
    assert len(group) == (4 if task == "kv_agent" else 5)
    worker = CellWorker(torch_threads=1)
    batched = []
    inner = batch.DecodeLoop
    monkeypatch.setattr(
        batch,
        "DecodeLoop",
        lambda engine, sessions, *a, **k: batched.append(len(sessions)) or inner(engine, sessions, *a, **k),
    )
    together = worker.run_group(group, 4)
    assert batched[0] == 4 and (task == "kv_agent" or batched == [4])  # one batch (per round, for episodes)
    alone = [worker.run(c) for c in group]
    if budget == "prompt+8":  # each its own prompt's length + 8
        assert [r["resolved_budget"] for r in alone] == [r["prompt_tokens"] + 8 for r in alone]
        assert len({r["resolved_budget"] for r in alone}) > 1
    for t, a, cell in zip(together, alone, group):
        assert t["cell_key"] == a["cell_key"] == cell.key and t["status"] == a["status"] == "ok", (
            t.get("error"),
            a.get("error"),
        )
        assert t["details"]["batch"] == {"cells": len(group)} and "batch" not in a["details"]
        assert t["details"]["backend"] == a["details"]["backend"] == "hf"
        for name in (
            "completion",
            "score",
            "correct",
            "extracted",
            "stop_reason",
            "generated_tokens",
            "prompt_tokens",
            "evictions",
            "evicted_tokens",
            "peak_cache_entries",
            "resolved_budget",
        ):
            assert t[name] == a[name], (name, cell.describe())
    assert sum(r["evictions"] for r in together) > 0


def test_an_injected_failure_in_a_group_fails_only_its_cell(tiny_models, tmp_path):
    cells = [c for c in expand(parse_config(config(tiny_models["llama"], tmp_path))).cells if c.task == "gsm8k"]
    group = next(g for g in batches(cells, 3) if len(g) >= 3)
    worker = CellWorker(torch_threads=1, inject_failures=[{"key": group[1].key, "message": "boom"}])
    rows = worker.run_group(group, 3)
    assert [r["status"] for r in rows] == ["ok", "failed"] + ["ok"] * (len(group) - 2)
    assert "boom" in rows[1]["error"] and [r["cell_key"] for r in rows] == [c.key for c in group]


def test_a_samples_fidelity_cells_group_and_equal_their_cells_one_by_one(tiny_models, tmp_path):
    """Fidelity groups are one sample's methods and budgets: one full-cache pass, answers forced together."""
    cfg = config(
        tiny_models["llama"],
        tmp_path,
        budgets=[16, 24],
        tasks=[{"name": "gsm8k", "limit": 2, "measure": "fidelity"}],
        fidelity={"max_scored_tokens": 20},
    )
    cells = expand(parse_config(cfg)).cells
    groups = batches(cells, 8)
    assert sorted(c.key for g in groups for c in g) == sorted(c.key for c in cells)
    for g in groups:  # one sample per group, its methods and budgets
        assert len({c.sample_id for c in g}) == 1 and {c.measure for c in g} == {"fidelity"}
    group = max(groups, key=len)
    assert len(group) >= 6 and len({c.budget for c in group}) == 2 and len({c.method for c in group}) == 3
    worker = CellWorker(torch_threads=1)
    together = worker.run_group(group)
    alone = [worker.run(c) for c in group]
    for t, a, cell in zip(together, alone, group):
        assert t["status"] == a["status"] == "ok", (t.get("error"), a.get("error"))
        assert t["details"]["batch"] == {"cells": len(group)}
        for name in ("scored_tokens", "evictions", "evicted_tokens", "peak_cache_entries", "prompt_tokens"):
            assert t[name] == a[name], (name, cell.describe())
        for name in ("kl_mean", "delta_nll_mean", "top1_agreement"):
            assert t[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), (name, cell.describe())
    # the group paid one full-cache pass: every row after the first says it was shared
    assert [r["details"]["fidelity"]["reference_shared"] for r in together][1:] == [True] * (len(group) - 1)
    assert sum(r["evictions"] for r in together) > 0
