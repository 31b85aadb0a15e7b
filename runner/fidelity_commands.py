"""``kvleague fidelity``: teacher-forced fidelity of methods and budgets on a task's reference
continuations (``runner/fidelity.py``), one full-cache pass per sample shared by every method."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from kvleague.engine.errors import KvleagueError


def register(subparsers) -> None:
    from kvleague.runner.cli_args import add_protocol_arguments

    p = subparsers.add_parser(
        "fidelity", help="KL to the full cache, delta NLL and top-1 agreement on reference continuations"
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", required=True)
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="task option")
    p.add_argument("--method", action="append", required=True, help="a method (repeat for several)")
    p.add_argument("--budget", action="append", type=int, required=True, help="a KV budget (repeat for several)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--sample-seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=64, help="scored (teacher-forced) tokens per sample at most")
    add_protocol_arguments(p)
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--data-dir", default=None)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="a sample's methods x budgets teacher-forced together (default: what fits in memory; 1: one at a time)",
    )
    p.add_argument(
        "--json", default=None, metavar="OUT", help="write per-sample and summary figures to OUT ('-': stdout)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvleague.methods.registry import build_method
    from kvleague.runner import fidelity
    from kvleague.runner.cli_args import protocol_from_args
    from kvleague.runner.models import load_engine
    from kvleague.runner.reference_tasks import load_samples, reference_task, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    task = reference_task(args.task, args.option, "for fidelity")
    methods = {name: build_method(name, {}) for name in dict.fromkeys(args.method)}
    protocol = protocol_from_args(args)
    for b in args.budget:
        protocol.check_budget(b)
    if args.batch_size is not None and args.batch_size < 1:
        raise KvleagueError(
            f"--batch-size: must be a positive integer (or omitted: what fits in memory), got {args.batch_size}"
        )

    # a sample's line comes when all its runs are done, minutes on long prompts: say what is under way first
    def progress(message: str) -> None:
        print(f"[{args.task}] {message}", file=sys.stderr, flush=True)

    # full is the same at every budget
    runs = [(name, b) for name, m in methods.items() for b in (args.budget[:1] if m.never_evicts else args.budget)]
    budgets = len(dict.fromkeys(args.budget))
    progress(
        f"up to {args.limit} samples x {len(methods)} methods x {budgets} budgets ({len(runs)} runs per sample, "
        f"a method that never evicts once); loading {args.model}; the time per sample, measured on the first, follows it"
    )
    loading = time.perf_counter()
    engine = load_engine(args.model, attn_implementation=args.attn_implementation, dtype=args.dtype)
    samples = load_samples(task, engine.tokenizer, args.limit, args.sample_seed, args.data_dir)
    progress(f"{len(samples)} samples, loaded in {time.perf_counter() - loading:.0f}s")
    rows: list[dict] = []
    start = time.perf_counter()

    def report() -> dict:
        return {
            "task": args.task,
            "model": args.model,
            "protocol": protocol.model_dump(mode="json"),
            "max_tokens": args.max_tokens,
            "samples_done": len({r["sample_id"] for r in rows}),
            "wall_seconds": time.perf_counter() - start,
            "summary": summarize(rows),
            "samples": rows,
        }

    for si, sample in enumerate(samples):
        segments = fidelity.truncate(task.fidelity_segments(sample, engine.tokenizer), args.max_tokens)
        progress(
            f"sample {si + 1}/{len(samples)}: a full-cache pass and {len(runs)} runs over {sum(len(s) for s, _ in segments):,} "
            f"tokens ({sum(len(s) for s, scored in segments if scored)} scored)"
        )
        t0 = time.perf_counter()
        reference = fidelity.full_cache_logprobs(engine, segments)
        ref_seconds = time.perf_counter() - t0
        results = fidelity.measure_batch(
            engine,
            [segments] * len(runs),
            [build_method(name, {}) for name, _ in runs],
            [b for _, b in runs],
            protocol,
            references=[reference] * len(runs),
            batch_size=args.batch_size,
        )
        for (name, budget), r in zip(runs, results):
            rows.append(
                {
                    "sample_id": sample.sample_id,
                    "method": name,
                    "budget": budget,
                    "prompt_tokens": r.generation.prompt_tokens,
                    "evictions": r.generation.evictions,
                    "reference_seconds": ref_seconds,
                    **r.to_dict(),
                }
            )
        progress(f"{si + 1}/{len(samples)} samples, {time.perf_counter() - start:.0f}s")
        if si == 0 and len(samples) > 1:
            progress(estimate(time.perf_counter() - start, len(samples)))
        if args.json and args.json != "-":  # after every sample, so a long run interrupted keeps what it measured
            write_report(args.json, report())
    for s in summarize(rows):
        print(
            f"{s['method']:<14} B={s['budget']:<5} n={s['samples']:<3} KL {s['kl_mean']:.4f} [{s['kl_lo']:.4f}, {s['kl_hi']:.4f}]  "
            f"top-1 {100 * s['top1']:.1f}% [{100 * s['top1_lo']:.1f}, {100 * s['top1_hi']:.1f}]  "
            f"dNLL {s['dnll_mean']:+.4f}  ms/token {s['ms_per_token']:.1f}"
        )
    if args.json == "-":
        print(json.dumps(report(), indent=1, default=str))
    return 0


def estimate(first: float, n: int) -> str:
    """The whole run's time from its first sample's (samples differ in length: a rough figure)."""
    finish = time.strftime("%H:%M", time.localtime(time.time() + first * (n - 1)))
    return (
        f"estimate: {first:.1f}s per sample (the first) x {n} samples = about {first * n:.0f}s "
        f"({first * n / 60:.1f} min), done around {finish}"
    )


def summarize(rows: list[dict]) -> list[dict]:
    """Per (method, budget): sample means of the per-sample means, with bootstrap intervals over samples
    (the dashboard's, :func:`analysis.fidelity_tables.bootstrap_mean_interval`)."""
    from kvleague.analysis.fidelity_tables import bootstrap_mean_interval

    out = []
    for key in dict.fromkeys((r["method"], r["budget"]) for r in rows):
        mine = [r for r in rows if (r["method"], r["budget"]) == key]
        kl, top1, dnll = (
            [r["kl_mean"] for r in mine],
            [r["top1_agreement"] for r in mine],
            [r["delta_nll_mean"] for r in mine],
        )
        tokens = sum(r["tokens"] for r in mine)
        kl_lo, kl_hi = bootstrap_mean_interval(kl)
        t_lo, t_hi = bootstrap_mean_interval(top1)
        d_lo, d_hi = bootstrap_mean_interval(dnll)
        out.append(
            {
                "method": key[0],
                "budget": key[1],
                "samples": len(mine),
                "tokens": tokens,
                "kl_mean": float(np.mean(kl)),
                "kl_lo": kl_lo,
                "kl_hi": kl_hi,
                "top1": float(np.mean(top1)),
                "top1_lo": t_lo,
                "top1_hi": t_hi,
                "dnll_mean": float(np.mean(dnll)),
                "dnll_lo": d_lo,
                "dnll_hi": d_hi,
                "ms_per_token": 1000 * sum(r["seconds"] for r in mine) / max(1, tokens),
            }
        )
    return out
