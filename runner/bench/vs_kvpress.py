"""The engine against kvpress at equal method, budget, model and prompt: decode tokens/s.

kvpress runs ``model.generate`` inside a ``DecodingPress`` wrapping ``StreamingLLMPress`` /
``KnormPress``, with ``compression_interval=1`` and ``target_size`` = the budget (and no hidden-state
buffer, which neither press reads), so after every decode step the cache is cut back to the budget;
the engine runs ``streaming_llm`` / ``knorm`` with ``cadence: every_step``, which does the same. The
prompt has exactly ``budget`` tokens (kvpress's ``DecodingPress`` does not compress the prefill), so
both evict one token at every decode step from the first. Decode time runs from the first generated
token to the last (a streamer timestamps ``model.generate``). Runs alternate; medians are compared;
the target is engine / kvpress >= 1.0.

"same tokens" (the agreeing prefix of the greedy tokens) compares like with like: kvpress's
``DecodingPress`` writes the kept entries back in the order ``topk`` returns them, not in position
order, and ``StreamingLLMPress`` assumes position order, so kvpress as is soon keeps neither the sinks
nor the recent window (docs/methods.md). The column is therefore taken against an untimed run of the
same kvpress scorer with its kept entries sorted back into position order and equal scores broken
towards the more recent position (kvleague's rule; ``topk`` leaves ties open); the agreement with
kvpress as is is reported next to it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvleague.runner.bench.cli import add_backend

METHODS = {"streaming_llm": "StreamingLLMPress", "knorm": "KnormPress"}
TARGET = 1.0
#: the printed table's columns: (field, header, format)
COLUMNS = [
    ("method", "method", ""),
    ("budget", "B", "d"),
    ("engine_tokens_per_second", "engine", ".2f"),
    ("kvpress_tokens_per_second", "kvpress", ".2f"),
    ("ratio", "engine/kvpress", ".3f"),
    ("same_tokens_prefix", "same tokens", "d"),
    ("same_tokens_prefix_kvpress_as_is", "same tokens (kvpress as is)", "d"),
]
#: one line per column of the printed table
KEY = {
    "B": "the budget: KV entries kept per layer and head (the prompt has exactly B tokens)",
    "engine, kvpress, engine/kvpress": "decode tokens per second, median over rounds, and their ratio",
    "same tokens": "greedy tokens the engine and kvpress agree on before the first difference, of all generated "
    "(kvpress with its kept entries sorted back into position order, as the engine keeps them)",
    "same tokens (kvpress as is)": "the same against kvpress unchanged, whose topk order loses the sinks and recent "
    "window (docs/methods.md)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_backend(p)
    p.add_argument("--budgets", type=int, nargs="+", help="default 1024 (quick 256)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode steps (default 512; quick 128)")
    p.add_argument("--methods", nargs="+", choices=sorted(METHODS), help="default: both")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3)")
    p.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto", help="auto: cpu without CUDA, else wall")
    p.add_argument("--threads", type=int, help="torch threads (default: 1 with the cpu clock)")


def kvpress_press(name: str, budget: int):
    import kvpress

    base = getattr(kvpress, METHODS[name])()
    if name == "streaming_llm":
        base.n_sink = 4  # the same as the engine's default n_sink
    return kvpress.DecodingPress(
        base_press=base, compression_interval=1, target_size=budget, hidden_states_buffer_size=0
    )


def time_kvpress(engine, name: str, budget: int, prompt: list[int], new_tokens: int, clock) -> dict:
    from kvleague.runner.bench.engine_vs_generate import time_generate

    return time_generate(engine, prompt, new_tokens, clock, press=kvpress_press(name, budget))


def run(args) -> dict:
    """The benchmark on each ``--backend`` in turn (``harness.across_backends``)."""
    from kvleague.runner.bench import harness as h

    return h.across_backends(args, run_one)


def run_one(args) -> dict:
    import logging

    from kvleague.engine.anchors import kvpress_reference_tokens
    from kvleague.runner.bench import harness as h
    from kvleague.runner.bench.engine_vs_generate import time_engine

    logging.getLogger("kvpress").setLevel(logging.ERROR)  # "compression_ratio will be overridden" on every press
    started = time.perf_counter()
    clock = h.Clock(args.clock)
    args.clock = clock.kind  # "auto" resolved, as the report records it
    threads = h.set_threads(clock, args.threads)
    budgets = args.budgets or ([256] if args.quick else [1024])
    new_tokens = args.new_tokens or (128 if args.quick else 512)
    rounds = args.rounds or 3
    names = args.methods or list(METHODS)
    source, engine, label = h.bench_engine(args)
    env = h.environment()
    print(
        f"engine vs kvpress DecodingPress: {label}; budgets {budgets}; {new_tokens} decode steps; {rounds} alternating rounds; "
        f"clock {args.clock}, {threads} thread(s)\n{h.describe_environment(env)}",
        flush=True,
    )
    rows, figures, ratios = [], [], []
    for budget in budgets:
        prompt = h.random_prompt(budget, seed=2)
        runs = {}
        for name in names:
            runs[f"engine:{name}"] = lambda name=name, prompt=prompt, budget=budget: time_engine(
                engine,
                prompt,
                new_tokens,
                clock,
                method=name,
                budget=budget,
            )
            runs[f"kvpress:{name}"] = lambda name=name, prompt=prompt, budget=budget: time_kvpress(
                engine, name, budget, prompt, new_tokens, clock
            )
        results = h.alternate(runs, rounds)
        for name in names:
            eng, kvp = results[f"engine:{name}"], results[f"kvpress:{name}"]
            e_tps, k_tps = h.median(r["decode_tps"] for r in eng), h.median(r["decode_tps"] for r in kvp)
            corrected = kvpress_reference_tokens(engine, kvpress_press(name, budget), prompt, new_tokens)
            agree = _agreeing_prefix(eng[0]["tokens"], corrected)
            row = {
                "method": name,
                "budget": budget,
                "engine_tokens_per_second": e_tps,
                "kvpress_tokens_per_second": k_tps,
                "ratio": h.ratio(e_tps, k_tps),
                "same_tokens_prefix": agree,
                "same_tokens_prefix_kvpress_as_is": _agreeing_prefix(eng[0]["tokens"], kvp[0]["tokens"]),
                "new_tokens": new_tokens,
                "rounds": rounds,
            }
            rows.append(row)
            ratios.append({"method": name, "budget": budget, "ratio": row["ratio"]})
            common: dict[str, Any] = dict(
                method=name, budget=budget, clock=args.clock, threads=threads, new_tokens=new_tokens
            )
            figures += [
                h.figure("decode_tokens_per_second", e_tps, "tokens/s", runner="engine", **common),
                h.figure(
                    "decode_tokens_per_second",
                    k_tps,
                    "tokens/s",
                    runner="kvpress",
                    press=f"DecodingPress({METHODS[name]})",
                    **common,
                ),
                h.figure("speed_ratio", row["ratio"], "x", reference="kvpress", target=TARGET, **common),
            ]
    config = {
        "model": source,
        "model_label": label,
        "budgets": budgets,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "methods": names,
        "clock": args.clock,
        "threads": threads,
        "compression_interval": 1,
        "cadence": "every_step",
        "quick": args.quick,
    }
    report = h.make_report(
        "vs_kvpress",
        config=config,
        rows=rows,
        figures=figures,
        summary={"ratios": ratios, "target": TARGET, "engine": engine.describe()},
        env=env,
        started=started,
    )
    print_report(report)
    return report


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def print_report(report: dict) -> None:
    from kvleague.runner.bench import harness as h

    print("\nengine vs kvpress (DecodingPress, compression every step), decode tokens/s")
    print(
        h.table(
            report["rows"],
            COLUMNS,
            KEY,
        )
    )
    print(f"target: engine / kvpress >= {report['summary']['target']}")


def main(argv: list[str] | None = None) -> dict:
    from kvleague.runner.bench.cli import run_script

    return run_script(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
