"""Continuous batching: a plain task's prompts decoded ``--batch-size`` rows at a time, in fixed chunks
(each chunk held to its longest sequence, as batching ran before) and continuously (a finished row
taken by the next prompt waiting, ``Engine.generate_batch``), per method.

Both ways decode the same prompts (the task's first ``--samples``, built as a sweep builds them; or,
``--task random``, random token ids of ``--prompt-tokens`` / 2 to ``--prompt-tokens`` each) under
the same method, budget and settings, alternating round by round on one clock (``--clock``), in one
process. Reported per method: generated tokens per second each way (wall time of the whole group:
prefill and decode), their ratio, the lengths' mean / longest (how much a fixed chunk waits), and
whether every sequence came out the same (tokens, kept positions; each equals it alone up to float
rounding of the batched kernels). The gain needs lengths that differ: a real model ends at its own
EOS; a random-weight one rarely does, and ``--eos-token`` names a token that also ends a sequence
(``auto``: the token whose first appearance, in a full-cache decode of the same prompts, spreads the
lengths most evenly: mean / longest nearest 0.5).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvleague.runner.bench.cli import add_backend


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_backend(p)
    p.add_argument(
        "--task", default="gsm8k", help="a plain (not episodic) task (default gsm8k), or random (random prompts)"
    )
    p.add_argument("--prompt-tokens", type=int, default=400, help="--task random: the longest prompt (default 400)")
    p.add_argument("--samples", type=int, default=None, help="prompts (default 32; quick 8)")
    p.add_argument("--batch-size", type=int, default=None, help="rows decoded together (default 8; quick 4)")
    p.add_argument("--methods", default="full,epikv", help="comma-separated method names")
    p.add_argument("--budget", type=int, default=None, help="KV budget (default 256; quick 96)")
    p.add_argument("--new-tokens", type=int, default=None, help="most new tokens per sequence (default 256; quick 32)")
    p.add_argument(
        "--eos-token",
        action="append",
        default=[],
        help="a token id that also ends a sequence, or auto (one that spreads the lengths); repeatable",
    )
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds (the median is reported)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="wall")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, or 1 with the cpu clock)")


def _decode(engine, prompts, method: str, budget: int, settings, rows: int, clock, continuous: bool) -> dict:
    from kvleague.methods import build_method

    start = clock.now()
    chunks = [prompts] if continuous else [prompts[i : i + rows] for i in range(0, len(prompts), rows)]
    results = [
        r
        for chunk in chunks
        for r in engine.generate_batch(
            chunk, [build_method(method) for _ in chunk], budget, None, settings, batch_size=rows
        )
    ]
    seconds = clock.now() - start
    return {
        "seconds": seconds,
        "generated": sum(r.generated_tokens for r in results),
        "lengths": [r.generated_tokens for r in results],
        "outcome": [(r.token_ids, r.kept_positions) for r in results],
    }


def _eos_tokens(values: list[str]) -> tuple[set[int], bool]:
    """``--eos-token`` values: the token ids, and whether ``auto`` was asked for."""
    from kvleague.engine.errors import KvleagueError

    for value in values:
        if value != "auto" and not value.isdigit():
            raise KvleagueError(f"eos_token: got {value!r}; allowed: a token id (a non-negative integer) or auto")
    return {int(v) for v in values if v != "auto"}, "auto" in values


def spreading_token(engine, prompts, new_tokens: int, rows: int) -> int:
    """The token whose first appearance in each prompt's full-cache greedy decode (EOS off, ``new_tokens``
    long) gives lengths with mean / longest nearest 0.5, among the 32 commonest tokens of those decodes."""
    from collections import Counter

    from kvleague.engine.protocol import GenerationSettings
    from kvleague.methods import build_method

    eos, engine.eos_ids = engine.eos_ids, set()
    try:
        room = max(len(p) for p in prompts) + new_tokens
        decodes = [
            r.token_ids
            for r in engine.generate_batch(
                prompts,
                [build_method("full") for _ in prompts],
                room,
                None,
                GenerationSettings(max_new_tokens=new_tokens),
                batch_size=rows,
            )
        ]
    finally:
        engine.eos_ids = eos

    def spread(token: int) -> float:
        lengths = [d.index(token) + 1 if token in d else len(d) for d in decodes]
        return abs(sum(lengths) / len(lengths) / max(lengths) - 0.5)

    return min((t for t, _ in Counter(t for d in decodes for t in d).most_common(32)), key=spread)


def run(args) -> dict:
    """The benchmark on each ``--backend`` in turn (``harness.across_backends``)."""
    from kvleague.runner.bench import harness as h

    return h.across_backends(args, run_one)


def run_one(args) -> dict:
    import torch

    from kvleague.engine.errors import KvleagueError
    from kvleague.engine.protocol import GenerationSettings
    from kvleague.runner.bench import harness as h
    from kvleague.tasks.episode import EpisodicTask
    from kvleague.tasks.registry import build_task

    started = time.perf_counter()
    clock = h.Clock(args.clock)
    threads = h.set_threads(clock, args.threads)
    n = args.samples or (8 if args.quick else 32)
    rows = args.batch_size or (4 if args.quick else 8)
    budget = args.budget or (96 if args.quick else 256)
    new_tokens = args.new_tokens or (32 if args.quick else 256)
    if rows < 1 or n < 1:
        raise KvleagueError(f"batch_size / samples: got {rows} / {n}; allowed: positive integers")
    methods = [m for m in args.methods.split(",") if m]
    task = None if args.task == "random" else build_task(args.task)
    if isinstance(task, EpisodicTask):
        raise KvleagueError(
            f"task: {args.task!r} is episodic; allowed: a plain task such as gsm8k, or random (episodes: kvleague bench episodes)"
        )
    if task is None and args.prompt_tokens < 2:
        raise KvleagueError(f"prompt_tokens: got {args.prompt_tokens}; allowed: an integer >= 2")
    eos_tokens, auto = _eos_tokens(args.eos_token)
    source, engine, label = h.bench_engine(args)
    engine.clock = clock.now
    if task is None:
        lengths = torch.randint(
            args.prompt_tokens // 2, args.prompt_tokens + 1, (n,), generator=torch.Generator().manual_seed(0)
        )
        prompts = [h.random_prompt(int(length), seed=i) for i, length in enumerate(lengths)]
    else:
        prompts = [task.build_prompt(sample, engine.tokenizer) for sample in task.load()[:n]]
    if auto:
        eos_tokens.add(spreading_token(engine, prompts, new_tokens, rows))
    engine.eos_ids = set(engine.backend.eos_ids) | eos_tokens  # (bench_engine turned EOS off)
    settings = GenerationSettings(max_new_tokens=new_tokens)
    env = h.environment()
    print(
        f"continuous batching: {label}; task {args.task}, {len(prompts)} prompts, {rows} rows, budget {budget}, at most "
        f"{new_tokens} new tokens, methods {methods}, also ending at {sorted(eos_tokens) or 'nothing else'}; "
        f"clock {args.clock}, {threads} thread(s)\n{h.describe_environment(env)}",
        flush=True,
    )
    runs = {
        (m, way): (lambda m=m, way=way: _decode(engine, prompts, m, budget, settings, rows, clock, way == "continuous"))
        for m in methods
        for way in ("chunked", "continuous")
    }
    results = h.alternate(runs, args.rounds, warmup=0)
    table, figures = [], []
    common: dict[str, Any] = dict(
        clock=args.clock, threads=threads, task=args.task, prompts=len(prompts), rows=rows, new_tokens=new_tokens
    )
    for m in methods:
        chunked, continuous = results[(m, "chunked")], results[(m, "continuous")]
        same = all(a["outcome"] == b["outcome"] for a, b in zip(chunked, continuous))
        per_round = {
            way: [r["generated"] / r["seconds"] for r in results[(m, way)]] for way in ("chunked", "continuous")
        }
        tps = {way: h.median(values) for way, values in per_round.items()}
        speedup = h.ratio(tps["continuous"], tps["chunked"])
        lengths = chunked[0]["lengths"]
        table.append(
            {
                "method": m,
                "tokens_per_second_chunked": tps["chunked"],
                "tokens_per_second_continuous": tps["continuous"],
                "speedup": speedup,
                "same_sequences": same,
                "generated_tokens": sum(lengths),
                "rounds_chunked": per_round["chunked"],
                "rounds_continuous": per_round["continuous"],
                "mean_over_longest": sum(lengths) / len(lengths) / max(1, max(lengths)),
            }
        )
        for way in ("chunked", "continuous"):
            figures.append(
                h.figure("batch_tokens_per_second", tps[way], "tokens/s", method=m, budget=budget, runner=way, **common)
            )
        figures.append(
            h.figure(
                "continuous_batching_speedup",
                speedup,
                "x",
                method=m,
                budget=budget,
                reference="chunked",
                same_sequences=same,
                **common,
            )
        )
    config = {
        "model": source,
        "model_label": label,
        "task": args.task,
        "prompts": len(prompts),
        "rows": rows,
        "budget": budget,
        "prompt_tokens": [len(p) for p in prompts] if task is None else None,
        "new_tokens": new_tokens,
        "methods": methods,
        "eos_tokens": sorted(eos_tokens),
        "rounds": args.rounds,
        "clock": args.clock,
        "threads": threads,
        "quick": args.quick,
    }
    summary = {
        "speedup": {r["method"]: r["speedup"] for r in table},
        "same_sequences": {r["method"]: r["same_sequences"] for r in table},
        "engine": engine.describe(),
    }
    report = h.make_report(
        "refill", config=config, rows=table, figures=figures, summary=summary, env=env, started=started
    )
    print("\nfixed chunks and continuous batching (generated tokens/s over the whole group: prefill and decode)")
    print(
        h.table(
            table,
            [
                ("method", "method", ""),
                ("generated_tokens", "tokens", "d"),
                ("mean_over_longest", "mean/longest", ".2f"),
                ("tokens_per_second_chunked", "chunked tok/s", ".2f"),
                ("tokens_per_second_continuous", "continuous tok/s", ".2f"),
                ("speedup", "x", ".2f"),
                ("same_sequences", "same", ""),
            ],
        )
    )
    return report
