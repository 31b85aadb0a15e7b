"""Batched decoding: engine tokens/s at batch 1, 4, 8, 16 per method, beside ``model.generate``.

For each method (default full, epikv, h2o) and batch size b, ``Engine.generate_batch`` decodes b
equal-length random prompts together (EOS ignored, greedy) under a budget below the prompt length,
so every method except ``full`` evicts after prefill and at every decode step; ``model.generate``
decodes the same prompts as one batch with a full cache. Throughput = b x (new tokens - 1) forward
passes over the decode time (first generated token to last: the engine's step times, a streamer for
``model.generate``, both read off ``--clock``), so both count the same passes and exclude prefill. All runs alternate round by
round, so every ratio compares runs made side by side under the same machine load.

``--static-anchor`` adds ``generate_static`` rows: ``model.generate`` with Hugging Face's static cache,
whose decode step transformers compiles on CUDA (``bench generate``'s anchor), per batch size.

``<method>/single`` rows are ``Engine.generate`` (the single-sequence path) on the first prompt, so
the batched path at batch 1 is compared with it.

On a backend that captures its decode steps as graphs (``slab`` on CUDA), every engine run first runs
once untimed (``--warmup``), so each (batch, capacity) shape is captured before any timed round; the
summary reports the captures made in the timed rounds (``graph_captures_timed``, 0 when the warm-up
reached every shape).

Targets (2 CPU cores): batch 8 / batch 1 >= 3.0 for full and >= 2.5 for epikv; engine (full) /
``model.generate`` >= 0.9 at every batch size.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TypedDict

from kvleague.runner.bench.cli import add_backend
from kvleague.runner.bench.engine_vs_generate import add_static_anchor, static_anchor, time_generate_batch

#: targets of the batch-8 / batch-1 speed-up per method, and of engine / generate
SPEEDUP_TARGETS = {"full": 3.0, "epikv": 2.5}
GENERATE_TARGET = 0.9


class _Conditions(TypedDict):
    """What every figure of a run records (``harness.figure``: ``budget`` its own field, the rest details)."""

    clock: str
    threads: int
    prompt_tokens: int
    new_tokens: int
    budget: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_backend(p)
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 400 (quick 64)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (quick 16)")
    p.add_argument("--budget", type=int, default=None, help="KV budget of the evicting methods (default prompt // 2)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,4,8,16; quick 1,4)")
    p.add_argument("--methods", default="full,epikv,h2o", help="comma-separated method names")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds (the median is reported)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="wall")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed rounds of the engine's runs first (default: 1 where decode steps are captured as graphs, else 0)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, or 1 with the cpu clock)")
    add_static_anchor(p)


def time_engine(engine, prompts: list[list[int]], method: str, budget: int, new_tokens: int) -> dict:
    from kvleague.engine.protocol import GenerationSettings, Protocol
    from kvleague.methods import build_method

    results = engine.generate_batch(
        prompts,
        [build_method(method) for _ in prompts],
        budget,
        Protocol(),
        GenerationSettings(max_new_tokens=new_tokens),
        batch_size=len(prompts),
    )
    # every sequence saw the same step times (they decode together); the first step only samples
    decode = results[0].decode_seconds_mean * results[0].generated_tokens
    return {
        "decode_tps": len(prompts) * (new_tokens - 1) / decode,
        "evictions": results[0].evictions,
        "tokens": [r.token_ids for r in results],
    }


def time_single(engine, prompt: list[int], method: str, budget: int, new_tokens: int) -> dict:
    """``Engine.generate`` (the single-sequence path), for the batch-1 comparison."""
    from kvleague.engine.protocol import GenerationSettings, Protocol
    from kvleague.methods import build_method

    result = engine.generate(
        prompt, build_method(method), budget, Protocol(), GenerationSettings(max_new_tokens=new_tokens)
    )
    decode = result.decode_seconds_mean * result.generated_tokens
    return {"decode_tps": (new_tokens - 1) / decode, "evictions": result.evictions, "tokens": [result.token_ids]}


def run(args) -> dict:
    """The benchmark on each ``--backend`` in turn (``harness.across_backends``)."""
    from kvleague.runner.bench import harness as h

    return h.across_backends(args, run_one)


def run_one(args) -> dict:
    from kvleague.runner.bench import harness as h

    started = time.perf_counter()
    clock = h.Clock(args.clock)
    threads = h.set_threads(clock, args.threads)
    prompt_tokens = args.prompt_tokens or (64 if args.quick else 400)
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    budget = args.budget or prompt_tokens // 2
    sizes = [int(x) for x in (args.batch_sizes or ("1,4" if args.quick else "1,4,8,16")).split(",")]
    methods = [m for m in args.methods.split(",") if m]
    source, engine, label = h.bench_engine(args)
    engine.clock = clock.now  # the engine's step times on the clock that times model.generate
    prompts = [h.random_prompt(prompt_tokens, seed=i) for i in range(max(sizes))]
    env = h.environment()
    print(
        f"batched decoding: {label}; prompts of {prompt_tokens}, {new_tokens} new tokens, budget {budget}, batch sizes "
        f"{sizes}, methods {methods}; clock {args.clock}, {threads} thread(s)\n{h.describe_environment(env)}",
        flush=True,
    )
    runs: dict[tuple[str, int], Callable[[], dict]] = {
        (f"{m}/single", 1): (lambda m=m: time_single(engine, prompts[0], m, budget, new_tokens)) for m in methods
    }
    for b in sizes:
        for m in methods:
            runs[(m, b)] = lambda m=m, b=b: time_engine(engine, prompts[:b], m, budget, new_tokens)
        runs[("generate", b)] = lambda b=b: time_generate_batch(engine, prompts[:b], new_tokens, clock)
    anchors = {}
    if args.static_anchor:
        for b in sizes:
            static_run, anchors[b] = static_anchor(
                engine,
                lambda b=b: time_generate_batch(engine, prompts[:b], new_tokens, clock, cache_implementation="static"),
                clock,
            )
            if static_run is not None:
                runs[("generate_static", b)] = static_run

    def announced(key, run):
        def call():
            out = run()
            print(f"  {key[0]} batch {key[1]}: {out['decode_tps']:.2f} tokens/s", flush=True)
            return out

        return call

    # captures before any timed round: each engine run once, untimed (model.generate's runs capture nothing)
    warmup = args.warmup if args.warmup is not None else int(bool(getattr(engine.backend, "graphs", False)))
    for _ in range(warmup):
        for key, run in runs.items():
            if key[0] not in ("generate", "generate_static"):
                run()
    captured = engine.describe().get("graph_captures")
    results = h.alternate({key: announced(key, run) for key, run in runs.items()}, args.rounds, warmup=0)
    rows = []
    tps = {}
    for (m, b), out in results.items():
        tps[(m, b)] = h.median(r["decode_tps"] for r in out)
        rows.append(
            {
                "method": m,
                "batch_size": b,
                "decode_tokens_per_second": tps[(m, b)],
                "speedup_vs_batch_1": h.ratio(tps[(m, b)], tps.get((m, sizes[0]))) if sizes[0] == 1 else None,
                "evictions": out[0].get("evictions"),
                "per_round_tps": [r["decode_tps"] for r in out],
            }
        )
    for row in rows:  # batch 1 may come after the others in the dict
        row["speedup_vs_batch_1"] = h.ratio(row["decode_tokens_per_second"], tps.get((row["method"], 1)))
    common = _Conditions(
        clock=args.clock, threads=threads, prompt_tokens=prompt_tokens, new_tokens=new_tokens, budget=budget
    )
    figures = [
        h.figure(
            "decode_tokens_per_second",
            row["decode_tokens_per_second"],
            "tokens/s",
            method=row["method"],
            batch_size=row["batch_size"],
            **common,
        )
        for row in rows
    ]
    summary: dict = {"speedup_batch_8": {}, "engine_over_generate": {}, "batch_1_over_single": {}}
    for m in methods:
        value = h.ratio(tps.get((m, 1)), tps.get((f"{m}/single", 1)))
        summary["batch_1_over_single"][m] = value
        figures.append(
            h.figure("batch_1_over_single", value, "x", method=m, batch_size=1, reference="Engine.generate", **common)
        )
    for m in methods + ["generate"]:
        value = h.ratio(tps.get((m, 8)), tps.get((m, 1)))
        summary["speedup_batch_8"][m] = value
        if value is not None:
            figures.append(
                h.figure(
                    "batch_speedup",
                    value,
                    "x",
                    method=m,
                    batch_size=8,
                    reference="batch_1",
                    target=SPEEDUP_TARGETS.get(m),
                    **common,
                )
            )
    if "full" in methods:
        for b in sizes:
            value = h.ratio(tps.get(("full", b)), tps.get(("generate", b)))
            same = results[("full", b)][0]["tokens"] == results[("generate", b)][0]["tokens"]
            summary["engine_over_generate"][b] = value
            figures.append(
                h.figure(
                    "speed_ratio",
                    value,
                    "x",
                    method="engine",
                    reference="generate",
                    batch_size=b,
                    target=GENERATE_TARGET,
                    same_tokens=same,
                    **common,
                )
            )
            if b in anchors and "error" in anchors[b]:
                summary.setdefault("engine_over_static", {})[b] = {**anchors[b], "ratio": None, "same_tokens": None}
            elif b in anchors:
                value = h.ratio(tps.get(("full", b)), tps.get(("generate_static", b)))
                same = results[("full", b)][0]["tokens"] == results[("generate_static", b)][0]["tokens"]
                summary.setdefault("engine_over_static", {})[b] = {**anchors[b], "ratio": value, "same_tokens": same}
                figures.append(
                    h.figure(
                        "speed_ratio",
                        value,
                        "x",
                        method="engine",
                        reference="generate_static",
                        batch_size=b,
                        target=GENERATE_TARGET,
                        same_tokens=same,
                        compiled=anchors[b]["compiled"],
                        **common,
                    )
                )
    summary["targets"] = {"speedup_batch_8": SPEEDUP_TARGETS, "engine_over_generate": GENERATE_TARGET}
    summary["engine"] = engine.describe()  # which paths the decode steps took (slab: captured or eager)
    summary["warmup_rounds"] = warmup
    if captured is not None:  # the slab backend: a graph is captured per (batch, capacity) at best
        summary["graph_captures_timed"] = summary["engine"]["graph_captures"] - captured
        print(
            f"graph captures: {summary['engine']['graph_captures']} over "
            f"{summary['engine']['graph_capture_shapes']} distinct (batch, capacity) shapes, "
            f"{summary['graph_captures_timed']} in the timed rounds (warm-up rounds: {warmup})",
            flush=True,
        )
    config = {
        "model": source,
        "model_label": label,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "budget": budget,
        "batch_sizes": sizes,
        "methods": methods,
        "rounds": args.rounds,
        "clock": args.clock,
        "threads": threads,
        "quick": args.quick,
        "static_anchor": args.static_anchor,
        "warmup": warmup,
    }
    report = h.make_report(
        "batch", config=config, rows=rows, figures=figures, summary=summary, env=env, started=started
    )
    print_report(report)
    return report


def print_report(report: dict) -> None:
    from kvleague.runner.bench import harness as h

    print("\nbatched decoding, decode only (tokens/s summed over the batch)")
    print(
        h.table(
            report["rows"],
            [
                ("method", "runner", ""),
                ("batch_size", "batch", "d"),
                ("decode_tokens_per_second", "tok/s", ".2f"),
                ("speedup_vs_batch_1", "x batch 1", ".2f"),
            ],
        )
    )
    s = report["summary"]
    for m, v in s["speedup_batch_8"].items():
        target = SPEEDUP_TARGETS.get(m)
        if v is not None:
            print(f"{m}: batch 8 / batch 1 = {v:.2f}" + (f" (target >= {target})" if target else ""))
    for m, v in s["batch_1_over_single"].items():
        if v is not None:
            print(f"{m}: generate_batch at batch 1 / Engine.generate = {v:.3f}")
    for b, v in s["engine_over_generate"].items():
        if v is not None:
            print(f"engine (full) / model.generate at batch {b}: {v:.3f} (target >= {GENERATE_TARGET})")
    for b, a in s.get("engine_over_static", {}).items():
        if "error" in a:
            print(f"model.generate with the static cache at batch {b}: failed ({a['error']})")
        elif a["ratio"] is not None:
            print(
                f"engine (full) / model.generate with the static cache ({'compiled' if a['compiled'] else 'not compiled'}; "
                f"first call {a['first_call_seconds']:.1f} s) at batch {b}: {a['ratio']:.3f} (target >= {GENERATE_TARGET}); "
                f"same tokens: {a['same_tokens']}"
            )


def main(argv: list[str] | None = None) -> dict:
    from kvleague.runner.bench.cli import common_parser, finish

    parser = common_parser(__doc__)
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return finish(run(args), args)


if __name__ == "__main__":
    main()
