"""Multi-turn episodes decoded together: an agentic task's episodes one by one (``run_sample``) and
together (``run_samples``: their decodes batched round by round, ``batch.drive_sessions``), per method.

Both ways play the same samples under the same method, budget, protocol and seed, alternating round
by round on one clock (``--clock``), in one process. Reported per method: episodes per second and
generated tokens per second each way (wall time of the whole episodes: prefill of every turn, decode,
tools), their ratio, and whether every episode came out the same (transcript, kept positions,
counters; batched decoding equals alone up to float rounding of the batched kernels). EOS is
ignored (the model's own stop strings still end a step), so a random-weight model's episodes take
one step per user turn.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvleague.runner.bench.cli import add_backend


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_backend(p)
    p.add_argument("--task", default="kv_agent", help="an episodic (agentic) task (default kv_agent)")
    p.add_argument("--samples", type=int, default=None, help="episodes, all decoded together (default 8; quick 4)")
    p.add_argument("--methods", default="full,h2o", help="comma-separated method names")
    p.add_argument("--budget", type=int, default=None, help="KV budget (default 256; quick 96)")
    p.add_argument("--new-tokens", type=int, default=None, help="most tokens per model step (default 48; quick 8)")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds (the median is reported)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="wall")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, or 1 with the cpu clock)")


def _play(engine, task, samples, method: str, budget: int, settings, clock, together: bool) -> dict:
    from kvleague.engine.protocol import Protocol
    from kvleague.methods import build_method
    from kvleague.runner.sample import run_sample, run_samples

    protocol, seeds = Protocol(), [0] * len(samples)
    start = clock.now()
    if together:
        runs = run_samples(
            engine, task, samples, [build_method(method) for _ in samples], budget, protocol, settings, seeds
        )
    else:
        runs = [run_sample(engine, task, s, build_method(method), budget, protocol, settings, 0) for s in samples]
    seconds = clock.now() - start
    return {
        "seconds": seconds,
        "generated": sum(r.generation.generated_tokens for r in runs),
        "steps": sum(r.details["episode"]["steps"] for r in runs),
        "outcome": [
            (r.completion, r.generation.kept_positions, r.generation.evictions, r.generation.prompt_tokens)
            for r in runs
        ],
    }


def run(args) -> dict:
    """The benchmark on each ``--backend`` in turn (``harness.across_backends``)."""
    from kvleague.runner.bench import harness as h

    return h.across_backends(args, run_one)


def run_one(args) -> dict:
    from kvleague.engine.errors import KvleagueError
    from kvleague.engine.protocol import GenerationSettings
    from kvleague.runner.bench import harness as h
    from kvleague.tasks.episode import EpisodicTask
    from kvleague.tasks.registry import build_task

    started = time.perf_counter()
    clock = h.Clock(args.clock)
    threads = h.set_threads(clock, args.threads)
    n = args.samples or (4 if args.quick else 8)
    budget = args.budget or (96 if args.quick else 256)
    new_tokens = args.new_tokens or (8 if args.quick else 48)
    methods = [m for m in args.methods.split(",") if m]
    task = build_task(args.task)
    if not isinstance(task, EpisodicTask):
        raise KvleagueError(
            f"task: {args.task!r} is not episodic; allowed: an agentic task such as kv_agent or bfcl_multi_turn"
        )
    samples = task.load()[:n]
    source, engine, label = h.bench_engine(args)
    engine.clock = clock.now
    settings = GenerationSettings(max_new_tokens=new_tokens)
    env = h.environment()
    print(
        f"episodes together: {label}; task {args.task}, {len(samples)} episodes, budget {budget}, at most {new_tokens} "
        f"tokens per step, methods {methods}; clock {args.clock}, {threads} thread(s)\n{h.describe_environment(env)}",
        flush=True,
    )
    runs = {
        (m, way): (lambda m=m, way=way: _play(engine, task, samples, m, budget, settings, clock, way == "together"))
        for m in methods
        for way in ("alone", "together")
    }
    results = h.alternate(runs, args.rounds, warmup=0)
    rows, figures = [], []
    common: dict[str, Any] = dict(
        clock=args.clock, threads=threads, task=args.task, episodes=len(samples), new_tokens=new_tokens
    )
    for m in methods:
        alone, together = results[(m, "alone")], results[(m, "together")]
        same = all(a["outcome"] == t["outcome"] for a, t in zip(alone, together))
        tps = {way: h.median(r["generated"] / r["seconds"] for r in results[(m, way)]) for way in ("alone", "together")}
        eps = {way: h.median(len(samples) / r["seconds"] for r in results[(m, way)]) for way in ("alone", "together")}
        speedup = h.ratio(tps["together"], tps["alone"])
        rows.append(
            {
                "method": m,
                "episodes_per_second_alone": eps["alone"],
                "episodes_per_second_together": eps["together"],
                "tokens_per_second_alone": tps["alone"],
                "tokens_per_second_together": tps["together"],
                "speedup": speedup,
                "same_episodes": same,
                "model_steps": alone[0]["steps"],
                "generated_tokens": alone[0]["generated"],
            }
        )
        for way in ("alone", "together"):
            figures.append(
                h.figure(
                    "episode_tokens_per_second", tps[way], "tokens/s", method=m, budget=budget, runner=way, **common
                )
            )
        figures.append(
            h.figure(
                "episodes_together_speedup",
                speedup,
                "x",
                method=m,
                budget=budget,
                reference="alone",
                same_episodes=same,
                **common,
            )
        )
    config = {
        "model": source,
        "model_label": label,
        "task": args.task,
        "episodes": len(samples),
        "budget": budget,
        "new_tokens": new_tokens,
        "methods": methods,
        "rounds": args.rounds,
        "clock": args.clock,
        "threads": threads,
        "quick": args.quick,
    }
    summary = {
        "speedup": {r["method"]: r["speedup"] for r in rows},
        "same_episodes": {r["method"]: r["same_episodes"] for r in rows},
        "engine": engine.describe(),
    }
    report = h.make_report(
        "episodes", config=config, rows=rows, figures=figures, summary=summary, env=env, started=started
    )
    print("\nepisodes one by one and together (generated tokens/s over whole episodes: prefill, decode, tools)")
    print(
        h.table(
            rows,
            [
                ("method", "method", ""),
                ("model_steps", "steps", "d"),
                ("tokens_per_second_alone", "alone tok/s", ".2f"),
                ("tokens_per_second_together", "together tok/s", ".2f"),
                ("speedup", "x", ".2f"),
                ("same_episodes", "same", ""),
            ],
        )
    )
    return report
