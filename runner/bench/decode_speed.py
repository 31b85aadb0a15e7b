"""Decode speed under a budget: tokens/s per method at budgets 256 / 1024 / 4096, beside full cache.

For every budget B each method gets a B-token random prompt (prefilled in chunks, not timed), so the
cache is full from the first decode step, then decodes ``--gen-factor`` x B tokens (default 4x) with
eviction at every step (``--cadence``). ``full`` (no eviction) decodes the same tokens in the same
run, its cache growing from B to (1 + factor) x B. Decoding is timed in 16 segments, so besides
tokens/s and time per output token the report shows whether the per-step cost stays flat once the
cache is full: ``flat`` = tokens/s over the last quarter / tokens/s over the first quarter (1.0 =
flat; full cache slows down as it grows).

Clock: by default the process CPU time with one torch thread (on a shared machine wall time mostly
measures the other tenants); ``--clock wall`` for wall time. Methods run in rotating order, and with
``--rounds`` > 1 the median over rounds is reported.

Default (budgets 256 1024 4096; full, epikv, h2o; 4x): tens of minutes on 2 CPU cores, mostly the
16384 steps of each method at B = 4096; ``--quick`` (budgets 256 1024; full, epikv) takes a few.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvleague.analysis import paper
from kvleague.runner.bench.cli import add_backend

DEFAULT_METHODS = ("full", "epikv", "h2o")
QUICK_METHODS = ("full", "epikv")
SEGMENTS = 16
#: the printed table's columns: (field, header, format)
COLUMNS = [
    ("method", "method", ""),
    ("budget", "B", "d"),
    ("tokens_per_second", "tok/s", ".2f"),
    ("ms_per_token", "ms/token", ".2f"),
    ("speed_vs_full", "x full", ".3f"),
    ("tps_first_quarter", "tok/s Q1", ".2f"),
    ("tps_last_quarter", "tok/s Q4", ".2f"),
    ("flat", "Q4/Q1", ".3f"),
    ("method_ms_per_token", "method ms", ".3f"),
    ("selection_ms_per_token", "select ms", ".3f"),
    ("method_share", "method %", ".2%"),
]
#: one line per column of the printed table (the per-run lines show tok/s, ms/token and Q4/Q1)
KEY = {
    "B": "the budget: KV entries kept per layer and head",
    "tok/s, ms/token": "decode speed over the whole run, median over rounds",
    "x full": "tok/s / the full cache's tok/s at the same B",
    "tok/s Q1, tok/s Q4": "tok/s over the first and the last quarter of the decoded tokens",
    "Q4/Q1": "tok/s Q4 / tok/s Q1: 1.0 = the per-token cost stays flat as the run goes on (a full cache slows)",
    "method ms, select ms": "per token: the method's scoring, and the engine's share of it (top-k, moving entries)",
    "method %": "the method's share of the wall time",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_backend(p)
    p.add_argument("--budgets", type=int, nargs="+", help="default 256 1024 4096 (quick: 256 1024)")
    p.add_argument("--methods", nargs="+", help=f"default {' '.join(DEFAULT_METHODS)} (full is always added)")
    p.add_argument(
        "--gen-factor", type=float, default=4.0, help="decode this many times the budget (>= 4 for the issue's claim)"
    )
    p.add_argument("--cadence", default="every_step", help="every_step (default) or buffer=N")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto", help="auto: cpu without CUDA, else wall")
    p.add_argument("--threads", type=int, help="torch threads (default: 1 with the cpu clock)")


def measure(engine, name: str, budget: int, prompt: list[int], steps: int, protocol, clock) -> dict:
    from kvleague.engine.protocol import GenerationSettings
    from kvleague.methods import build_method

    method = build_method(name)
    cache_budget = budget if not method.never_evicts else 1 << 40
    seg = max(1, steps // SEGMENTS)
    lengths = [seg] * (steps // seg) + ([steps % seg] if steps % seg else [])
    times, walls = [], []
    with engine.session(method, cache_budget, protocol) as session:
        session.feed(prompt)
        session.decode(GenerationSettings(max_new_tokens=1))  # first token: from the prefill logits
        method0, select0 = session.method_seconds, session.selection_seconds
        for n in lengths:
            start, wall = clock.now(), time.perf_counter()
            session.decode(GenerationSettings(max_new_tokens=n))  # n forward passes (the previous token first)
            times.append(clock.now() - start)
            walls.append(time.perf_counter() - wall)
        result = session.result()
        method_s, select_s = session.method_seconds - method0, session.selection_seconds - select0
    total = sum(times)
    q = max(1, len(times) // 4)
    first, last = sum(lengths[:q]) / sum(times[:q]), sum(lengths[-q:]) / sum(times[-q:])
    return {
        "method": name,
        "budget": budget,
        "steps": steps,
        "tokens_per_second": steps / total,
        "ms_per_token": 1000.0 * total / steps,
        "tps_first_quarter": first,
        "tps_last_quarter": last,
        "flat": last / first,
        # the engine's own counters are wall clock: their share is taken of the wall time
        "method_ms_per_token": 1000.0 * method_s / steps,
        "selection_ms_per_token": 1000.0 * select_s / steps,
        "method_share": method_s / sum(walls),
        "final_cache_entries": result.peak_cache_entries if method.never_evicts else budget,
        "peak_kv_bytes": result.peak_kv_bytes,
        "attn_implementation": result.attn_implementation,
        "evictions": result.evictions,
    }


def run(args) -> dict:
    """The benchmark on each ``--backend`` in turn (``harness.across_backends``)."""
    from kvleague.runner.bench import harness as h

    return h.across_backends(args, run_one)


def run_one(args) -> dict:
    from kvleague.engine.protocol import Protocol
    from kvleague.runner.bench import harness as h

    started = time.perf_counter()
    clock = h.Clock(args.clock)
    args.clock = clock.kind  # "auto" resolved, as the report records it
    threads = h.set_threads(clock, args.threads)
    budgets = args.budgets or ([256, 1024] if args.quick else [256, 1024, 4096])
    names = list(dict.fromkeys(["full", *(args.methods or (QUICK_METHODS if args.quick else DEFAULT_METHODS))]))
    source, engine, label = h.bench_engine(args)
    protocol = Protocol(cadence=args.cadence, prefill_chunk=args.prefill_chunk)
    env = h.environment()
    print(
        f"decode speed: {label}; budgets {budgets}; {args.gen_factor:g}x the budget decoded; cadence {args.cadence}; "
        f"clock {args.clock}, {threads} torch thread(s)\n{h.describe_environment(env)}",
        flush=True,
    )
    rows = []
    for budget in budgets:
        prompt = h.random_prompt(budget, seed=budget)
        steps = max(1, int(round(args.gen_factor * budget)))
        measure(engine, "full", min(budget, 64), prompt[:64], 8, protocol, clock)  # warm-up
        per_round: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                out = measure(engine, name, budget, prompt, steps, protocol, clock)
                per_round[name].append(out)
                print(
                    f"  B={budget:5d} {name:14s} {out['tokens_per_second']:8.2f} tok/s  {out['ms_per_token']:7.2f} ms/token  "
                    f"Q4/Q1 {out['flat']:.3f}",
                    flush=True,
                )
        for name in names:
            runs = per_round[name]
            row = dict(runs[0])
            for key in (
                "tokens_per_second",
                "ms_per_token",
                "tps_first_quarter",
                "tps_last_quarter",
                "flat",
                "method_ms_per_token",
                "selection_ms_per_token",
                "method_share",
            ):
                row[key] = h.median(x[key] for x in runs)
            row["rounds"] = len(runs)
            rows.append(row)
    full = {r["budget"]: r for r in rows if r["method"] == "full"}
    for r in rows:
        r["speed_vs_full"] = h.ratio(r["tokens_per_second"], full[r["budget"]]["tokens_per_second"])
    figures, ratios = [], []
    for r in rows:
        common: dict[str, Any] = dict(
            method=r["method"],
            budget=r["budget"],
            clock=args.clock,
            threads=threads,
            steps=r["steps"],
            cadence=args.cadence,
            attn_implementation=r["attn_implementation"],
        )
        figures += [
            h.figure("tokens_per_second", r["tokens_per_second"], "tokens/s", **common),
            h.figure("ms_per_token", r["ms_per_token"], "ms", **common),
            h.figure("flatness_last_over_first_quarter", r["flat"], "x", **common),
            h.figure(
                "method_share_of_step",
                r["method_share"],
                "fraction",
                clock_of_value="wall",
                **{k: v for k, v in common.items() if k != "clock"},
            ),
        ]
        if r["method"] != "full":
            figures.append(
                h.figure(
                    "speed_ratio",
                    r["speed_vs_full"],
                    "x",
                    reference="full",
                    paper_claim=paper.SPEEDUP_VS_FULL if r["method"] == paper.REFERENCE_METHOD else None,
                    **common,
                )
            )
    by_key = {(r["method"], r["budget"]): r for r in rows}
    for budget in budgets:
        for a, b in (("epikv", "h2o"), ("epikv", "full")):
            if (a, budget) in by_key and (b, budget) in by_key:
                value = h.ratio(by_key[a, budget]["tokens_per_second"], by_key[b, budget]["tokens_per_second"])
                ratios.append({"numerator": a, "denominator": b, "budget": budget, "ratio": value})
                if b != "full":  # (epikv / full is already a speed_ratio figure)
                    figures.append(
                        h.figure("speed_ratio", value, "x", method=a, budget=budget, reference=b, clock=args.clock)
                    )
    config = {
        "model": source,
        "model_label": label,
        "budgets": budgets,
        "methods": names,
        "gen_factor": args.gen_factor,
        "cadence": args.cadence,
        "prefill_chunk": args.prefill_chunk,
        "rounds": args.rounds,
        "clock": args.clock,
        "threads": threads,
        "segments": SEGMENTS,
        "quick": args.quick,
    }
    report = h.make_report(
        "decode_speed",
        config=config,
        rows=rows,
        figures=figures,
        summary={"ratios": ratios, "paper_claim_speedup": paper.SPEEDUP_VS_FULL, "engine": engine.describe()},
        env=env,
        started=started,
    )
    print_report(report)
    return report


def print_report(report: dict) -> None:
    from kvleague.runner.bench import harness as h

    print(
        f"\ndecode speed ({report['config']['clock']} clock; {report['config']['gen_factor']:g}x the budget decoded after a full cache)"
    )
    print(
        h.table(
            report["rows"],
            COLUMNS,
            KEY,
        )
    )
    for q in report["summary"]["ratios"]:
        value = f"{q['ratio']:.3f}x" if q["ratio"] is not None else "-"
        print(f"  B={q['budget']:5d} {q['numerator']} / {q['denominator']}: {value}")


def main(argv: list[str] | None = None) -> dict:
    from kvleague.runner.bench.cli import run_script

    return run_script(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
