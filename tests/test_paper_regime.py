"""The EpiKV paper's regime (issue 30): budgets relative to each sample's prompt, fidelity over the
model's own long greedy trace, and whether a method's ranking decided anything.

Oracles: Hugging Face's ``model.generate`` with the same tokens suppressed (the trace); the same
measurement under the absolute budget and recent window worked out by hand (a relative budget); the
protocol's arithmetic (which evictions leave the method a choice); a cell's own rows (one trace per
sample, whatever group it ran in)."""

from __future__ import annotations

import pytest
import torch

from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import PRESETS, Protocol
from kvleague.methods.registry import build_method
from kvleague.runner import fidelity
from kvleague.runner.sweep_config import parse_config
from kvleague.runner.sweeping.cell import CellWorker
from kvleague.runner.sweeping.grid import batches, expand

# -- relative budgets ------------------------------------------------------------------------------


def test_a_relative_budget_is_the_prompt_plus_room_with_the_window_of_the_room():
    paper = Protocol.preset("epikv_paper", budget_base="prompt")
    resolved, budget = paper.for_prompt(64, prompt_tokens=700)
    assert budget == 764
    # the authors' window is a quarter of the budget up to 128; here a quarter of the room
    assert resolved.recent_for(budget) == 16 and resolved.budget_base == "none"
    assert {
        k: v for k, v in resolved.model_dump().items() if k not in ("recent", "recent_max_fraction", "budget_base")
    } == {k: v for k, v in paper.model_dump().items() if k not in ("recent", "recent_max_fraction", "budget_base")}
    assert paper.for_prompt(1024, 10)[0].recent_for(1034) == 128
    absolute = PRESETS["epikv_paper"]
    assert absolute.for_prompt(64, 700) == (absolute, 64)
    # a protocol at the default leaves the field out of its hash: stored keys keep theirs
    assert "budget_base" not in absolute.spec() and paper.spec()["budget_base"] == "prompt"


def _sweep(model, tmp_path, **over) -> dict:
    return {
        "name": "regime",
        "database": f"sqlite:///{tmp_path / 'r.db'}",
        "models": [{"source": str(model), "dtype": "float32"}],
        "methods": ["full", "h2o", "streaming_llm"],
        "budgets": ["prompt+8", "prompt+16"],
        "tasks": [{"name": "gsm8k", "limit": 3, "measure": "fidelity"}],
        "protocol": {"sink": 2, "recent": 4, "protect_prompt": True},
        "fidelity": {"max_scored_tokens": 40, "reference": "self"},
        **over,
    }


def test_prompt_plus_n_budgets_set_the_protocol_and_bad_ones_are_one_line(tiny_models, tmp_path):
    cfg = parse_config(_sweep(tiny_models["llama"], tmp_path, protocol="epikv_paper"))
    assert cfg.budgets == [8, 16] and cfg.protocol.budget_base == "prompt"
    assert cfg.protocol_for("math", False) == Protocol.preset("epikv_paper", budget_base="prompt")
    for bad, says in (
        (["prompt+8", 16], "all integers, all prompt\\+N"),
        (["prompt+x"], "got 'prompt\\+x'"),
        (["prompt-8"], "got 'prompt-8'"),
    ):
        with pytest.raises(KvleagueError, match=f"budgets: .*{says}"):
            parse_config(_sweep(tiny_models["llama"], tmp_path, budgets=bad))
    with pytest.raises(KvleagueError, match="budgets: prompt\\+N needs protocol.budget_base prompt, got 'none'"):
        parse_config(_sweep(tiny_models["llama"], tmp_path, protocol={"budget_base": "none"}))
    # an episode's budget cannot count from a prompt it has not seen yet
    episodic = _sweep(tiny_models["llama"], tmp_path, tasks=[{"name": "kv_agent", "limit": 1}], fidelity={})
    with pytest.raises(KvleagueError, match="tasks\\[0\\].measure: kv_agent is episodic"):
        expand(parse_config(episodic))
    both = _sweep(tiny_models["llama"], tmp_path, tasks=[{"name": "gsm8k", "limit": 1, "measure": "both"}])
    with pytest.raises(KvleagueError, match="tasks\\[0\\].measure: with fidelity.reference self"):
        expand(parse_config(both))


def test_fidelity_under_a_relative_budget_is_fidelity_under_its_resolved_absolute_one(engines):
    engine = engines["qwen2"]
    ids = engine.tokenizer(
        "Every cache keeps what it can, and the rest is gone for good. " * 3, add_special_tokens=False
    )["input_ids"]
    segments = [(ids[:30], False), (ids[30:70], True)]
    relative = Protocol(sink=2, recent=8, recent_max_fraction=0.25, protect_prompt=True, budget_base="prompt")
    got = fidelity.measure(engine, segments, build_method("h2o", {}), 20, relative, per_token=True)
    # by hand: 30 prompt tokens + 20 of room; the window a quarter of the room (5), not of 50 (12 -> 8)
    absolute = Protocol(sink=2, recent=5, protect_prompt=True)
    want = fidelity.measure(engine, segments, build_method("h2o", {}), 50, absolute, per_token=True)
    assert got.generation.budget == 50 and got.generation.evicted_tokens == want.generation.evicted_tokens > 0
    assert got.per_token == want.per_token and got.generation.kept_positions == want.generation.kept_positions


# -- self-generated traces -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_self_traces_are_hf_greedy_generation_with_special_tokens_suppressed(engines, arch):
    engine = engines[arch]
    prompts = [
        engine.tokenizer(t, add_special_tokens=False)["input_ids"]
        for t in ("The first trace starts here", "A second, longer prompt that the model continues in its own words")
    ]
    traces = fidelity.self_traces(engine, prompts, 48)
    banned = sorted(set(engine.tokenizer.all_special_ids) | set(engine.eos_ids))
    for prompt, trace in zip(prompts, traces):
        out = engine.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=48,
            min_new_tokens=48,
            do_sample=False,
            suppress_tokens=banned,
            pad_token_id=banned[0],
        )
        assert trace == out[0, len(prompt) :].tolist()
        assert len(trace) == 48 and not set(trace) & set(banned)


def test_a_self_trace_sweep_scores_every_cell_of_a_sample_on_one_trace(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEAGUE_TRACE_CACHE", str(tmp_path / "traces"))
    cells = expand(parse_config(_sweep(tiny_models["llama"], tmp_path, batch_size=7))).cells
    groups = batches(cells, 7)
    per_sample = 1 + 2 * 2  # full once, two methods at two budgets
    assert len(cells) == 3 * per_sample
    for g in groups:  # whole samples: a group never splits one
        for sample in {c.sample_id for c in g}:
            assert sum(c.sample_id == sample for c in g) == per_sample
    assert max(len({c.sample_id for c in g}) for g in groups) == 2  # 2 samples fill 7 cells
    worker = CellWorker(torch_threads=1)
    rows = [r for g in groups for r in worker.run_group(g)]
    assert all(r["status"] == "ok" for r in rows), [r.get("error") for r in rows]
    by_sample: dict[str, set] = {}
    for cell, row in zip([c for g in groups for c in g], rows):
        fid = row["details"]["fidelity"]
        by_sample.setdefault(cell.sample_id, set()).add(fid["scored_sha256"])
        assert row["scored_tokens"] == 40
        # the prompt plus the room: every budget counts from the sample's own prompt
        assert row["resolved_budget"] == row["prompt_tokens"] + cell.budget
        if cell.method != "full":
            assert row["evicted_tokens"] > 0 and 0 < row["ranked_evictions"] <= row["evictions"]
    assert all(len(hashes) == 1 for hashes in by_sample.values()) and len(by_sample) == 3
    # a cell run alone (a fresh worker: the trace generated again, at batch 1) sees the same trace
    monkeypatch.delenv("KVLEAGUE_TRACE_CACHE")
    alone = CellWorker(torch_threads=1).run(cells[-1])
    assert alone["details"]["fidelity"]["scored_sha256"] in by_sample[cells[-1].sample_id]
    assert alone["details"]["fidelity"]["self_trace_seconds"] > 0
    # ... and with the trace cache, a later worker reads the stored one instead of decoding it
    monkeypatch.setenv("KVLEAGUE_TRACE_CACHE", str(tmp_path / "traces"))
    assert len(list((tmp_path / "traces").glob("*.json"))) == 3
    cached = CellWorker(torch_threads=1).run(cells[0])
    assert cached["details"]["fidelity"]["self_trace_seconds"] == 0.0
    assert cached["details"]["fidelity"]["scored_sha256"] in by_sample[cells[0].sample_id]


# -- whether the method chose ------------------------------------------------------------------------


def test_ranked_evictions_count_only_evictions_the_methods_ranking_decided(engines, prompt_ids):
    engine = engines["llama"]
    method = lambda: build_method("h2o", {})  # noqa: E731
    # prompt compressed, sink + recent < B: every eviction keeps some candidates and drops others
    with engine.session(method(), 24, Protocol(sink=2, recent=4), 0) as s:
        s.feed(prompt_ids[:40])
        s.teacher_force(prompt_ids[40:60], lambda logits, token: None)
        r = s.result()
    assert r.evictions > 0 and r.ranked_evictions == r.evictions
    # the prompt (40) kept whole beyond B = 24: each generated token goes right after its own pass
    keep = Protocol(sink=0, recent=4, protect_prompt=True, prompt_over_budget="keep")
    with engine.session(method(), 24, keep, 0) as s:
        s.feed(prompt_ids[:40])
        s.teacher_force(prompt_ids[40:60], lambda logits, token: None)
        r = s.result()
    assert r.evictions > 0 and r.evicted_tokens > 0 and r.ranked_evictions == 0
    # under the budget: nothing evicted, nothing ranked
    with engine.session(method(), 200, Protocol(sink=2, recent=4), 0) as s:
        s.feed(prompt_ids[:40])
        r = s.result()
    assert r.evictions == r.ranked_evictions == 0


def test_a_session_refuses_a_budget_that_was_never_resolved(engines):
    with pytest.raises(KvleagueError, match="budget_base: 'prompt' is resolved per prompt before a session starts"):
        engines["llama"].session(build_method("h2o", {}), 64, Protocol(budget_base="prompt"), 0)
