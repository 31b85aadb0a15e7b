"""``kvleague bench {context,speed,kvpress,generate,batch,refill,episodes,busy,all,store,targets}``: the systems benchmarks
(``runner/bench``).

Each prints a table; ``--json OUT`` writes the report (for ``all``: a directory, one file per
benchmark); ``--store`` writes the figures into the results database (``--db URL``), and
``kvleague bench store REPORT.json ...`` stores reports written earlier. ``kvleague bench targets
DIR`` reads a ``scripts/gpu_check.sh`` folder into the fast GPU backend's targets table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvleague.runner.bench import (
    batch,
    decode_speed,
    device_busy,
    engine_vs_generate,
    episodes,
    feasible_context,
    gpu_targets,
    refill,
    vs_kvpress,
)
from kvleague.runner.bench.cli import add_common, finish

BENCHES = {
    "context": (feasible_context, "longest prompt per method under a memory cap"),
    "speed": (decode_speed, "decode tokens/s per method at budgets 256/1024/4096 beside full cache"),
    "kvpress": (vs_kvpress, "engine vs kvpress DecodingPress at equal method and budget"),
    "generate": (engine_vs_generate, "engine vs model.generate with no eviction"),
    "batch": (batch, "batched decoding: tokens/s at batch 1/4/8/16 per method beside model.generate"),
    "refill": (
        refill,
        "continuous batching: a task's prompts in fixed chunks and with finished rows refilled, per method",
    ),
    "episodes": (episodes, "multi-turn agentic episodes one by one and decoded together, per method"),
    "busy": (device_busy, "how busy the device is during decode steps (torch profiler), per method and batch size"),
}


def register(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="systems benchmarks: feasible context, decode speed, vs kvpress, vs generate"
    )
    sub = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench))
    for name, (module, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or "").strip().splitlines()[0])
        add_common(p)
        module.add_arguments(p)
        p.set_defaults(func=_runner(module))
    p = sub.add_parser("all", help="every benchmark above with its defaults (--quick: a few minutes each)")
    add_common(p)
    p.set_defaults(func=cmd_all)
    p = sub.add_parser("store", help="store reports written earlier with --json into the database")
    p.add_argument("reports", nargs="+", metavar="REPORT.json")
    p.add_argument("--db", metavar="URL", help="database URL (default: $KVLEAGUE_DB or sqlite:///kvleague.db)")
    p.set_defaults(func=cmd_store)
    p = sub.add_parser(
        "targets",
        help="the fast GPU backend's targets table from a scripts/gpu_check.sh folder",
        description=(gpu_targets.__doc__ or "").strip().splitlines()[0],
    )
    gpu_targets.add_arguments(p)
    p.set_defaults(func=cmd_targets)


def _runner(module):
    def run(args) -> int:
        finish(module.run(args), args)
        return 0

    return run


def cmd_all(args) -> int:
    out_dir = Path(args.json) if args.json else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    for name, (module, _) in BENCHES.items():
        parser = argparse.ArgumentParser()
        add_common(parser)
        module.add_arguments(parser)
        sub_args = parser.parse_args([])
        for key in ("model", "quick", "store", "db"):
            setattr(sub_args, key, getattr(args, key))
        sub_args.json = str(out_dir / f"{module.__name__.rsplit('.', 1)[-1]}.json") if out_dir else None
        print(f"\n=== kvleague bench {name} ===", flush=True)
        finish(module.run(sub_args), sub_args)
    return 0


def cmd_store(args) -> int:
    from kvleague.db.session import default_url, display_url
    from kvleague.engine.errors import KvleagueError
    from kvleague.runner.bench.harness import read_report
    from kvleague.runner.bench.storage import check_storable, store_report
    from kvleague.runner.sweep_config import clip

    for path in args.reports:
        try:
            report = read_report(path)
            check_storable(report)
        except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise KvleagueError(clip(f"{path}: not a benchmark report: {exc}")) from None
        n = store_report(report, args.db)
        print(
            f"{path}: stored {n} new figures of {report['benchmark']} run {report['run_id'][:12]} "
            f"in {display_url(args.db or default_url())}"
        )
    return 0


def cmd_targets(args) -> int:
    gpu_targets.run(args)
    return 0
