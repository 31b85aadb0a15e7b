"""The systems-benchmark harness: the limit search, the report schema, storing figures in the
database and reading them back, the subprocess memory probe, and each benchmark end to end on a
tiny model. No timing is asserted: only that the measuring machinery measures what it says."""

from __future__ import annotations

import json
import math

import pytest

from kvleague.engine.errors import KvleagueError
from kvleague.runner.bench import harness as h
from kvleague.runner.bench import storage

# -- the limit search ---------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 1000, 1023, 1024, 1025, 4095, 5000, 9999])
@pytest.mark.parametrize("start", [1, 64, 1024])
@pytest.mark.parametrize("cap_first", [True, False])
def test_search_finds_a_planted_limit_exactly(limit, start, cap_first):
    seen = []

    def probe(n):
        seen.append(n)
        return n <= limit

    result = h.search_limit(probe, start=start, cap=10_000, resolution=1, cap_first=cap_first)
    assert result.limit == limit and not result.capped and result.upper == limit + 1
    assert [p.size for p in result.probes] == seen and all(p.fits == (p.size <= limit) for p in result.probes)
    assert len(seen) <= 2 * math.log2(10_000) + 3  # doubling + bisection, not a scan


def test_search_reports_the_cap_when_everything_fits_and_zero_when_nothing_does():
    capped = h.search_limit(lambda n: True, start=8, cap=100)
    assert (capped.limit, capped.capped, capped.upper, [p.size for p in capped.probes]) == (100, True, None, [100])
    doubling = h.search_limit(lambda n: True, start=8, cap=100, cap_first=False)
    assert doubling.limit == 100 and doubling.capped and [p.size for p in doubling.probes] == [8, 16, 32, 64, 100]
    nothing = h.search_limit(lambda n: False, start=8, cap=100)
    assert nothing.limit == 0 and not nothing.capped and nothing.upper == 1


def test_search_stops_at_the_requested_resolution_and_keeps_probe_details():
    result = h.search_limit(
        lambda n: (n <= 3000, {"peak": n * 10}), start=1024, cap=100_000, resolution=64, relative=0.0
    )
    assert result.limit <= 3000 < result.upper and result.upper - result.limit <= 64
    assert all(p.detail == {"peak": p.size * 10} for p in result.probes)
    coarse = h.search_limit(lambda n: n <= 3000, start=1024, cap=100_000, resolution=1, relative=0.25)
    assert coarse.upper - coarse.limit <= 0.25 * coarse.limit and len(coarse.probes) < len(result.probes)


def test_alternate_interleaves_runs_and_rotates_the_first():
    calls = []
    out = h.alternate({"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}, rounds=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"] and out == {"a": [1, 1, 1], "b": [2, 2, 2]}


# -- the report schema ------------------------------------------------------------------------------

ENV = {key: "x" for key in h.ENVIRONMENT_KEYS}


def _report(**over):
    figures = [
        h.figure("speed_ratio", 1.25, "x", method="epikv", budget=256, reference="full", clock="cpu"),
        h.figure("max_tokens", 4096, "tokens", method="h2o", budget=1024, at_least=False),
        h.figure("ratio", float("nan"), "x"),
    ]
    return h.make_report(
        "decode_speed",
        config={"model": "m", **over},
        rows=[{"method": "epikv"}],
        figures=figures,
        summary={},
        env=dict(ENV),
    )


def test_a_report_has_the_schema_and_survives_json(tmp_path):
    report = _report()
    assert report["figures"][2]["value"] is None  # NaN is stored as missing, never as invalid JSON
    path = h.write_report(report, tmp_path / "sub" / "r.json")
    assert h.read_report(path) == json.loads(json.dumps(report))
    assert set(report) == {
        "schema_version",
        "benchmark",
        "run_id",
        "created_at",
        "elapsed_seconds",
        "environment",
        "config",
        "rows",
        "figures",
        "summary",
    }


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda r: r.pop("figures"), "figures: expected list"),
        (lambda r: r.update(benchmark="nope"), "benchmark: unknown 'nope'"),
        (lambda r: r["environment"].pop("git_commit"), "environment: missing git_commit"),
        (lambda r: r["figures"][0].pop("unit"), "figures[0]: missing unit"),
        (lambda r: r["figures"][0].update(value="fast"), "figures[0].value: unexpected type str"),
        (lambda r: r["figures"][0].update(budget=True), "figures[0].budget: unexpected type bool"),
        (lambda r: r["figures"][1].update(colour="red"), "figures[1]: unknown keys colour"),
        (lambda r: r["figures"][1].update(value=float("inf")), "figures[1].value: not finite"),
        (lambda r: r["rows"].append(3), "rows[1]: not an object"),
    ],
)
def test_the_schema_check_names_each_problem(mutate, message):
    report = _report()
    mutate(report)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        h.validate_report(report)


def test_environment_records_the_machine_and_the_code():
    env = h.environment()
    assert set(h.ENVIRONMENT_KEYS) <= set(env)
    assert env["cpu_count"] >= 1 and env["cpu_model"] and env["torch_version"] and env["git_commit"]
    assert env["gpu_name"] == "none" or env["gpu_count"] >= 1


# -- the database -------------------------------------------------------------------------------------


def test_figures_are_stored_once_and_read_back(db_url):
    report = _report()
    report["environment"] = h.environment()
    assert storage.store_report(report, db_url) == 3
    assert storage.store_report(report, db_url) == 0  # the same report again: nothing new
    other = _report()
    other["environment"] = report["environment"]
    assert storage.store_report(other, db_url) == 3
    rows = storage.read_figures(db_url, run_id=report["run_id"])
    assert [{k: r[k] for k in h.FIGURE_KEYS} for r in rows] == report["figures"]
    assert all(r["benchmark"] == "decode_speed" and r["model"] == "m" and r["environment_id"] for r in rows)
    assert len(storage.read_figures(db_url, benchmark="decode_speed")) == 6
    assert storage.read_figures(db_url, benchmark="vs_kvpress") == []


def test_storing_an_invalid_report_writes_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'bench.db'}"
    report = _report()
    report["figures"][0]["value"] = "fast"
    with pytest.raises(ValueError):
        storage.store_report(report, url)


# -- the memory probe ---------------------------------------------------------------------------------


def test_probe_subprocess_reports_the_peak_and_is_stopped_over_the_cap(tiny_models):
    from kvleague.runner.bench.feasible_context import GIB, measure_in_subprocess

    spec = {
        "model": str(tiny_models["llama"]),
        "method": "h2o",
        "tokens": 48,
        "budget": 16,
        "decode_steps": 4,
        "prefill_chunk": None,
        "threads": 1,
    }
    fits = measure_in_subprocess(spec, 8 * GIB, timeout=300)
    assert fits["ok"] and fits["fits"] and fits["attn_implementation"] == "eager"
    # the kernel's high-water mark covers everything the child did, at least its RSS after loading
    assert fits["peak_bytes"] == fits["peak_rss_bytes"] >= max(fits["rss_loaded_bytes"], fits["vmhwm_bytes"]) > 0
    over = measure_in_subprocess(spec, 1 << 20, timeout=300)  # 1 MiB: no interpreter fits
    assert not over["fits"] and over["killed"] == "memory"


# -- every benchmark end to end on a tiny model (figures, not speed) -----------------------------------


def _cli(argv):

    from kvleague.runner import bench_commands
    from kvleague.runner.cli_args import OneLineParser

    parser = OneLineParser(prog="kvleague")
    bench_commands.register(parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser))
    args = parser.parse_args(argv)
    assert args.func(args) == 0


def test_bench_generate_and_kvpress_write_reports(tiny_models, tmp_path, capsys):
    model = str(tiny_models["llama"])
    _cli(
        [
            "bench",
            "generate",
            "--model",
            model,
            "--prompt-tokens",
            "24",
            "--new-tokens",
            "12",
            "--rounds",
            "1",
            "--json",
            str(tmp_path / "g.json"),
        ]
    )
    g = h.read_report(tmp_path / "g.json")
    assert g["summary"]["same_tokens"] is True  # no eviction: the engine reproduces model.generate
    assert {f["method"] for f in g["figures"]} == {"engine", "generate"} and g["summary"][
        "ratio_engine_over_generate"
    ] > 0
    first = next(f for f in g["figures"] if f["metric"] == "first_pass_ratio")
    assert (
        first["value"] == g["summary"]["first_pass_tps"] / g["summary"]["second_pass_tps"]
        and first["details"]["target"] == 0.9
    )
    _cli(
        [
            "bench",
            "kvpress",
            "--model",
            model,
            "--budgets",
            "16",
            "--new-tokens",
            "8",
            "--rounds",
            "1",
            "--json",
            str(tmp_path / "k.json"),
        ]
    )
    k = h.read_report(tmp_path / "k.json")
    assert [(r["method"], r["budget"]) for r in k["rows"]] == [("streaming_llm", 16), ("knorm", 16)]
    assert all(r["ratio"] > 0 for r in k["rows"])
    assert "engine/kvpress" in capsys.readouterr().out


def test_bench_speed_measures_each_method_beside_full_and_stores(tiny_models, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'b.db'}"
    _cli(
        [
            "bench",
            "speed",
            "--model",
            str(tiny_models["qwen2"]),
            "--budgets",
            "8",
            "16",
            "--methods",
            "epikv",
            "h2o",
            "--gen-factor",
            "4",
            "--json",
            str(tmp_path / "s.json"),
            "--store",
            "--db",
            url,
        ]
    )
    s = h.read_report(tmp_path / "s.json")
    assert [(r["method"], r["budget"], r["steps"]) for r in s["rows"]] == [
        (m, b, 4 * b) for b in (8, 16) for m in ("full", "epikv", "h2o")
    ]
    assert all(r["evictions"] == (0 if r["method"] == "full" else r["steps"]) for r in s["rows"])
    assert {(q["numerator"], q["denominator"], q["budget"]) for q in s["summary"]["ratios"]} == {
        ("epikv", "h2o", 8),
        ("epikv", "full", 8),
        ("epikv", "h2o", 16),
        ("epikv", "full", 16),
    }
    stored = storage.read_figures(url, run_id=s["run_id"])
    assert len(stored) == len(s["figures"]) and "stored" in capsys.readouterr().out


@pytest.mark.slow  # the slow tier (KVLEAGUE_SLOW=1 bash scripts/test.sh)
def test_bench_context_searches_each_method_in_subprocesses(tiny_models, tmp_path):
    _cli(
        [
            "bench",
            "context",
            "--model",
            str(tiny_models["llama"]),
            "--methods",
            "epikv",
            "h2o",
            "--memory-gib",
            "8",
            "--max-tokens",
            "64",
            "--start",
            "32",
            "--budget",
            "16",
            "--prefill-chunk",
            "16",
            "--decode-steps",
            "2",
            "--threads",
            "1",
            "--json",
            str(tmp_path / "c.json"),
        ]
    )
    c = h.read_report(tmp_path / "c.json")
    rows = {r["method"]: r for r in c["rows"]}
    assert rows["epikv"]["max_tokens"] == 64 and rows["epikv"]["at_least"] and rows["epikv"]["prefill_chunk"] == 16
    assert rows["h2o"]["attn_implementation"] == "eager" and rows["h2o"]["prefill_chunk"] is None
    assert c["summary"]["ratios"] == [
        {"numerator": "epikv", "denominator": "h2o", "ratio": 1.0, "at_least": False, "undetermined": True}
    ]


def test_bench_store_puts_saved_reports_into_the_database(tmp_path, capsys):
    report = _report()
    report["environment"] = h.environment()
    path = h.write_report(report, tmp_path / "r.json")
    url = f"sqlite:///{tmp_path / 'b.db'}"
    _cli(["bench", "store", str(path), str(path), "--db", url])
    out = capsys.readouterr().out
    assert "stored 3 new figures" in out and "stored 0 new figures" in out
    assert len(storage.read_figures(url)) == 3
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(KvleagueError, match="not a benchmark report"):
        _cli(["bench", "store", str(tmp_path / "bad.json"), "--db", url])


def test_bench_reports_bad_input_as_a_clean_error():
    with pytest.raises(KvleagueError, match="invalid choice"):
        _cli(["bench", "nope"])
