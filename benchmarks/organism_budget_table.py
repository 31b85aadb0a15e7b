"""Accuracy vs KV budget for every registered eviction method on the organism (models/organism).

    python benchmarks/organism_budget_table.py                       # long-dependency variant, 30 samples/task
    python benchmarks/organism_budget_table.py --variant default --samples 50 --budgets 32 64 128 256
    python benchmarks/organism_budget_table.py --methods full streaming_llm snapkv --json table.json

Each cell is the mean accuracy over the four synthetic tasks (greedy decoding through the real
engine, the same held-out samples for every method); ``--per-task`` prints one table per task too.
The protocol is the same for every method: ``sink`` / ``recent`` tokens protected (defaults 4 / 16, so
the question itself survives every budget), prompt compressed (``protect_prompt`` off: the context
is the prompt), eviction every step, absolute positions. ``full`` ignores the budget: its row is the
ceiling. A method that fails on a cell prints ``err`` there (the message goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {"default": {}, "long": {"length": 520, "min_distance": 320}}


def main(argv: list[str] | None = None) -> int:
    import torch

    from methods.registry import available_methods
    from runner.engine import Engine
    from runner.organism import SYNTH_TASKS, task_accuracy
    from runner.protocol import Protocol
    from tasks.registry import build_task

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/organism")
    p.add_argument("--methods", nargs="*", default=None, help="default: every registered method")
    p.add_argument("--budgets", nargs="*", type=int, default=[32, 64, 128, 256])
    p.add_argument("--samples", type=int, default=30, help="held-out samples per task")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="long")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--recent", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--per-task", action="store_true")
    p.add_argument("--json", default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model)
    methods = args.methods or list(available_methods())
    protocol = Protocol(sink=args.sink, recent=args.recent)
    tasks = {name: build_task(name, VARIANTS[args.variant]) for name in SYNTH_TASKS}
    samples = {name: task.load(limit=args.samples, seed=0) for name, task in tasks.items()}
    columns = [str(b) for b in args.budgets] + ["full"]
    table: dict[str, dict[str, dict[str, float | None]]] = {}
    start = time.perf_counter()
    for method in methods:
        table[method] = {}
        for col in columns:
            budget = None if col == "full" else int(col)
            cell: dict[str, float | None] = {}
            for name, task in tasks.items():
                try:
                    # "full" column: every method with a budget above the prompt, i.e. nothing evicted
                    cell[name] = task_accuracy(engine, task, samples[name], method, budget, protocol)
                except Exception as exc:  # one broken method must not hide the others
                    print(f"{method} budget={col} {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    cell[name] = None
            table[method][col] = cell
        print(f"  {method} done ({time.perf_counter() - start:.0f}s)", file=sys.stderr, flush=True)

    def fmt(v: float | None) -> str:
        return " err" if v is None else f"{100 * v:4.0f}"

    def mean(cell: dict[str, float | None]) -> float | None:
        vals = list(cell.values())
        return None if any(v is None for v in vals) else sum(vals) / len(vals)

    print(f"\nAccuracy (%) on the organism, {args.variant} variant ({VARIANTS[args.variant] or 'task defaults'}), "
          f"{args.samples} samples x {len(tasks)} tasks, sink={args.sink} recent={args.recent}")
    header = f"{'method':<16}" + "".join(f"{'B=' + c if c != 'full' else 'full':>8}" for c in columns)
    print("mean over tasks\n" + header)
    for method in methods:
        print(f"{method:<16}" + "".join(f"{fmt(mean(table[method][c])):>8}" for c in columns))
    if args.per_task:
        for name in tasks:
            print(f"\n{name}\n" + header)
            for method in methods:
                print(f"{method:<16}" + "".join(f"{fmt(table[method][c][name]):>8}" for c in columns))
    if args.json:
        Path(args.json).write_text(json.dumps({"variant": args.variant, "options": VARIANTS[args.variant],
                                               "samples": args.samples, "sink": args.sink, "recent": args.recent,
                                               "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
