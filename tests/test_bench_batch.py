"""``kvleague bench batch`` end to end on a tiny model: the report's structure and its token checks,
never its speed (speed targets live in the benchmark's own output)."""

from __future__ import annotations

import pytest

from kvleague.engine.errors import KvleagueError
from kvleague.runner.bench import harness as h
from tests.test_bench import _cli


def test_bench_batch_reports_every_method_and_batch_size_beside_generate(tiny_models, tmp_path, capsys):
    _cli(
        [
            "bench",
            "batch",
            "--model",
            str(tiny_models["qwen2"]),
            "--prompt-tokens",
            "24",
            "--new-tokens",
            "6",
            "--batch-sizes",
            "1,2,8",
            "--methods",
            "full,epikv",
            "--threads",
            "1",
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    report = h.read_report(tmp_path / "b.json")
    assert report["benchmark"] == "batch"
    rows = {(r["method"], r["batch_size"]): r for r in report["rows"]}
    assert set(rows) == {("full/single", 1), ("epikv/single", 1)} | {
        (m, b) for m in ("full", "epikv", "generate") for b in (1, 2, 8)
    }
    assert all(r["decode_tokens_per_second"] > 0 for r in report["rows"])
    assert all(rows[("epikv", b)]["evictions"] > 0 for b in (1, 2, 8)) and rows[("full", 8)]["evictions"] == 0
    assert set(report["summary"]["speedup_batch_8"]) == {"full", "epikv", "generate"}
    # no eviction and equal-length prompts: the batched engine decodes exactly what model.generate does
    same = [f for f in report["figures"] if f["metric"] == "speed_ratio"]
    assert [f["details"]["batch_size"] for f in same] == [1, 2, 8] and all(f["details"]["same_tokens"] for f in same)
    assert {f["metric"] for f in report["figures"]} >= {
        "decode_tokens_per_second",
        "batch_speedup",
        "batch_1_over_single",
    }
    assert "batch 8 / batch 1" in capsys.readouterr().out


def test_bench_batch_times_the_engine_and_generate_on_one_clock(tiny_models, tmp_path, monkeypatch):
    """``--clock cpu`` read by both sides: under a CPU clock that advances one unit per reading, a decode
    step takes at least one unit, so no sequence decodes faster than a token per unit. An engine timed
    on the wall clock instead (milliseconds per step) would report thousands of tokens per unit."""
    import itertools
    import time

    ticks = itertools.count()
    monkeypatch.setattr(time, "process_time", lambda: float(next(ticks)))
    _cli(
        [
            "bench",
            "batch",
            "--model",
            str(tiny_models["qwen2"]),
            "--prompt-tokens",
            "16",
            "--new-tokens",
            "5",
            "--batch-sizes",
            "1,2",
            "--methods",
            "full",
            "--clock",
            "cpu",
            "--static-anchor",
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    report = h.read_report(tmp_path / "b.json")
    rows = report["rows"]
    assert {(r["method"], r["batch_size"]) for r in rows} == {
        ("full/single", 1),
        ("full", 1),
        ("full", 2),
        ("generate", 1),
        ("generate", 2),
        ("generate_static", 1),
        ("generate_static", 2),
    }
    # the static-cache anchor decodes what the engine does, at each batch size
    assert {b: a["same_tokens"] for b, a in report["summary"]["engine_over_static"].items()} == {"1": True, "2": True}
    for r in rows:
        assert 0 < r["decode_tokens_per_second"] <= r["batch_size"], r


def test_a_static_anchor_that_cannot_compile_is_reported_and_the_rest_still_runs(tiny_models, tmp_path, monkeypatch):
    """Where ``torch.compile`` cannot build (no C compiler, say), the anchor's first call fails: the
    report names the error and every other row is there."""
    from kvleague.runner.bench import batch

    real = batch.time_generate_batch

    def failing(engine, prompts, new_tokens, clock, **kwargs):
        if kwargs.get("cache_implementation") == "static":
            raise RuntimeError("inductor: no working C compiler\nmore detail")
        return real(engine, prompts, new_tokens, clock, **kwargs)

    monkeypatch.setattr(batch, "time_generate_batch", failing)
    _cli(
        [
            "bench",
            "batch",
            "--model",
            str(tiny_models["qwen2"]),
            "--prompt-tokens",
            "16",
            "--new-tokens",
            "4",
            "--batch-sizes",
            "1",
            "--methods",
            "full",
            "--static-anchor",
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    report = h.read_report(tmp_path / "b.json")
    assert {(r["method"], r["batch_size"]) for r in report["rows"]} == {
        ("full/single", 1),
        ("full", 1),
        ("generate", 1),
    }
    assert report["summary"]["engine_over_static"]["1"]["error"] == "inductor: no working C compiler"


def test_bench_episodes_plays_them_alone_and_together_with_the_same_outcome(tiny_models, tmp_path, capsys):
    """``kvleague bench episodes``: an agentic task's episodes one by one and decoded together, per
    method; in float32 the two agree here (same transcripts, kept positions, counters)."""
    _cli(
        [
            "bench",
            "episodes",
            "--model",
            str(tiny_models["llama"]),
            "--samples",
            "3",
            "--budget",
            "64",
            "--new-tokens",
            "4",
            "--methods",
            "full,h2o",
            "--threads",
            "1",
            "--json",
            str(tmp_path / "e.json"),
        ]
    )
    report = h.read_report(tmp_path / "e.json")
    assert report["benchmark"] == "episodes" and [r["method"] for r in report["rows"]] == ["full", "h2o"]
    for row in report["rows"]:
        assert row["same_episodes"] and row["tokens_per_second_alone"] > 0 and row["tokens_per_second_together"] > 0
        assert row["model_steps"] >= 3 and row["speedup"] > 0
    assert {f["metric"] for f in report["figures"]} == {"episode_tokens_per_second", "episodes_together_speedup"}
    assert "together tok/s" in capsys.readouterr().out
    with pytest.raises(KvleagueError, match=r"^task: 'gsm8k' is not episodic; allowed: an agentic task"):
        _cli(["bench", "episodes", "--model", str(tiny_models["llama"]), "--task", "gsm8k"])


def test_bench_refill_decodes_fixed_chunks_and_continuously_with_the_same_sequences(tiny_models, tmp_path, capsys):
    """``kvleague bench refill``: a task's prompts in fixed chunks of three rows and continuously (a
    finished row taken by the next prompt), per method; an EOS the model emits makes the lengths differ,
    and every sequence comes out the same both ways."""
    from kvleague.engine.protocol import GenerationSettings
    from kvleague.methods import build_method
    from kvleague.runner.bench.refill import spreading_token
    from kvleague.runner.models import load_engine
    from kvleague.tasks.registry import build_task

    engine = load_engine(str(tiny_models["llama"]))
    engine.eos_ids = set()
    prompts = [build_task("gsm8k").build_prompt(s, engine.tokenizer) for s in build_task("gsm8k").load()[:6]]
    eos = spreading_token(engine, prompts, 12, 3)  # auto: a token the full-cache decodes emit, first at spread steps
    free = engine.generate_batch(
        prompts, [build_method("full") for _ in prompts], 200, None, GenerationSettings(max_new_tokens=12)
    )
    firsts = [r.token_ids.index(eos) + 1 if eos in r.token_ids else 12 for r in free]
    assert len(set(firsts)) > 1 and min(firsts) < 12
    _cli(
        [
            "bench",
            "refill",
            "--model",
            str(tiny_models["llama"]),
            "--samples",
            "6",
            "--batch-size",
            "3",
            "--budget",
            "48",
            "--new-tokens",
            "12",
            "--eos-token",
            "auto",
            "--methods",
            "full,h2o",
            "--threads",
            "1",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    report = h.read_report(tmp_path / "r.json")
    assert report["config"]["eos_tokens"] == [eos]
    assert report["benchmark"] == "refill" and [r["method"] for r in report["rows"]] == ["full", "h2o"]
    for row in report["rows"]:
        assert (
            row["same_sequences"] and row["tokens_per_second_chunked"] > 0 and row["tokens_per_second_continuous"] > 0
        )
        assert row["mean_over_longest"] < 1  # the EOS ended some sequences early
    assert {f["metric"] for f in report["figures"]} == {"batch_tokens_per_second", "continuous_batching_speedup"}
    assert "continuous tok/s" in capsys.readouterr().out
    with pytest.raises(KvleagueError, match=r"^task: 'kv_agent' is episodic; allowed: a plain task"):
        _cli(["bench", "refill", "--model", str(tiny_models["llama"]), "--task", "kv_agent"])
    with pytest.raises(
        KvleagueError, match=r"^eos_token: got 'x'; allowed: a token id \(a non-negative integer\) or auto$"
    ):
        _cli(["bench", "refill", "--model", str(tiny_models["llama"]), "--eos-token", "x"])
    # random prompts (the GPU check's step, which has no task data): a spreading EOS, both ways the same
    _cli(
        [
            "bench",
            "refill",
            "--model",
            str(tiny_models["llama"]),
            "--task",
            "random",
            "--prompt-tokens",
            "24",
            "--samples",
            "5",
            "--batch-size",
            "2",
            "--budget",
            "16",
            "--new-tokens",
            "10",
            "--eos-token",
            "auto",
            "--methods",
            "epikv",
            "--threads",
            "1",
            "--json",
            str(tmp_path / "random.json"),
        ]
    )
    report = h.read_report(tmp_path / "random.json")
    assert all(12 <= n <= 24 for n in report["config"]["prompt_tokens"]) and report["rows"][0]["same_sequences"]


@pytest.mark.parametrize("warmup", [None, 0])
def test_bench_batch_captures_every_graph_before_its_timed_rounds(tiny_models, tmp_path, monkeypatch, warmup):
    """On the slab backend's captured path (run eagerly off CUDA, captures counted as on a GPU), the
    default warm-up runs each engine run once first: no capture falls in a timed round. Without it the
    first round captures every shape."""
    bench_engine = h.bench_engine

    def graphed(args):
        source, engine, label = bench_engine(args)
        engine.backend.graphs = True
        engine.backend.pool.clear()
        engine.backend._graphed.clear()
        return source, engine, label

    monkeypatch.setattr(h, "bench_engine", graphed)
    args = ["bench", "batch", "--model", str(tiny_models["llama"]), "--backend", "slab", "--prompt-tokens", "20"]
    args += ["--new-tokens", "5", "--batch-sizes", "1,2", "--methods", "full,epikv", "--rounds", "2", "--threads", "1"]
    _cli([*args, *([] if warmup is None else ["--warmup", str(warmup)]), "--json", str(tmp_path / "b.json")])
    summary = h.read_report(tmp_path / "b.json")["summary"]
    engine = summary["engine"]
    assert engine["decode_steps"]["static"] > 0 and engine["graph_captures"] <= engine["graph_capture_shapes"]
    if warmup is None:
        assert summary["warmup_rounds"] == 1 and summary["graph_captures_timed"] == 0
    else:
        assert summary["warmup_rounds"] == 0 and summary["graph_captures_timed"] == engine["graph_captures"] > 0
