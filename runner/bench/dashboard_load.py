"""Time to compute the leaderboard page's data on a 200k-row results table (target: under 2 s; with
``--methods 1000``, under 10 s).

Seeds a fresh SQLite database through the db layer (migrations, ``db.store.write_results`` in bulk
batches) with a synthetic sweep of ``--rows`` sample results (10 methods x 4 budgets x 5 tasks), then
times, without Streamlit's cache, what the Leaderboard page computes on a first visit: the filter
options and the leaderboard (per-cell rows, the common problem set of each table, Wilson and Tango
score intervals and tests, each method against full cache and against the table's best: linear in the
methods). Best and median of ``--repeats`` runs. ``--methods N``: the seeder's methods plus synthetic
variants up to N (each a spec of its own), for the leaderboard at scale.

    python -m runner.bench.dashboard_load [--rows 200000] [--methods N] [--n-samples 1] [--db URL] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvleague.analysis import queries as q
from kvleague.analysis import tables
from kvleague.db.seed import METHODS, ROBUSTNESS, TASKS, RealisticSpec, Seeder, realistic_rows

TARGET_S = 2.0
#: the target with 1,000 methods (issue 45)
TARGET_MANY_S = 10.0
BUDGETS = (1024, 2048, 4096, 8192)
#: share of the problems per task
SHARES = {"math500": 0.30, "aime24": 0.10, "humaneval": 0.20, "kv_agent": 0.20, "niah": 0.20}
#: (task, domain, share of problems, full-cache accuracy, typical generated tokens): the seeder's tasks
TASK_MIX = tuple((name, domain, SHARES[name], acc, typical) for name, domain, _, acc, typical in TASKS)


def spec_for(rows: int, n_samples: int, completion_chars: int, n_methods: int = 0) -> RealisticSpec:
    methods = tuple(METHODS) + tuple(m for m in ("knorm",) if m in ROBUSTNESS)
    methods += tuple(f"variant_{i:04d}" for i in range(max(0, n_methods - len(methods))))
    per_problem = len(methods) * len(BUDGETS) * n_samples
    problems = max(len(TASK_MIX), rows // per_problem)
    tasks = []
    left = problems
    for i, (name, domain, share, acc, typical) in enumerate(TASK_MIX):
        n = left if i == len(TASK_MIX) - 1 else max(1, round(problems * share))
        left -= n
        tasks.append((name, domain, n, acc, typical))
    return RealisticSpec(
        methods=methods,
        budgets=BUDGETS,
        tasks=tuple(tasks),
        n_samples=n_samples,
        temperature=0.6 if n_samples > 1 else 0.0,
        completion_chars=completion_chars,
        sweep="load-benchmark",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument(
        "--n-samples", type=int, default=1, help="samples per problem (>1: sampled decoding, design-effect path)"
    )
    p.add_argument("--completion-chars", type=int, default=300)
    p.add_argument("--methods", type=int, default=0, help="method specs in all (synthetic variants added)")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--db", default=None, help="seed this database instead of a temporary SQLite file (must be empty)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from kvleague.db.session import get_engine

    tmp = None
    if args.db is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvleague-load-")
        url = f"sqlite:///{tmp.name}/load.db"
    else:
        url = args.db
    writer = get_engine(url)
    spec = spec_for(args.rows, args.n_samples, args.completion_chars, args.methods)
    target = TARGET_MANY_S if len(spec.methods) > 100 else TARGET_S
    t0 = time.perf_counter()
    seeder = Seeder(writer)
    n = seeder.write(realistic_rows(seeder, spec), chunk=20_000)
    seed_s = time.perf_counter() - t0
    print(f"seeded {n:,} sample results in {seed_s:.1f}s ({n / seed_s:,.0f} rows/s) into {url}", flush=True)

    reader = q.open_readonly(url) if url.startswith("sqlite") else writer
    timings: list[float] = []
    opt_t: list[float] = []
    lb_t: list[float] = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        q.fingerprint(reader)
        q.options(reader)
        t1 = time.perf_counter()
        lb = tables.leaderboard(reader, q.Filters(), args.budget)
        t2 = time.perf_counter()
        opt_t.append(t1 - t)
        lb_t.append(t2 - t1)
        timings.append(t2 - t)
    best, median = min(timings), statistics.median(timings)
    print(
        f"leaderboard page data (budget {args.budget}, {len(lb.by_domain)} method x domain cells, "
        f"{int(lb.by_domain['problems'].sum()):,} problem results): best {best:.3f}s, median {median:.3f}s "
        f"(options {min(opt_t):.3f}s + leaderboard {min(lb_t):.3f}s), {len(spec.methods)} methods; target < "
        f"{target:.1f}s: {'met' if best < target else 'NOT met'}; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"methods x domains at budget {args.budget}:")
    print(lb.wide[["rank", "method", "mean accuracy"]].head(15).to_string(index=False))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": n,
                    "seed_seconds": seed_s,
                    "best_seconds": best,
                    "median_seconds": median,
                    "options_seconds": min(opt_t),
                    "leaderboard_seconds": min(lb_t),
                    "methods": len(spec.methods),
                    "target_seconds": target,
                },
                indent=2,
            )
        )
    writer.dispose()
    reader.dispose()
    if tmp is not None:
        tmp.cleanup()
    return 0 if best < target else 1


if __name__ == "__main__":
    raise SystemExit(main())
