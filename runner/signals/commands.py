"""``kvleague signals``: which per-token signals predict occlusion importance (issue 21).

Per sample: labels and signals (``runner/signals/study.py``); over the samples: Spearman's rho of every
signal against every label, pooled as the EpiKV authors pool, with bootstrap intervals over samples
(``runner/signals/correlation.py``); the correlations go to the database with provenance
(``runner/signals/store.py``) and, with ``--json``, to a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
import uuid
from datetime import datetime, timezone

from kvleague.engine.errors import KvleagueError

#: the control signal (the token's absolute index in the context) that the partial rho holds fixed
POSITION = "position"


def register(subparsers) -> None:
    from kvleague.runner.reference_tasks import OCCLUDED, TRACES

    p = subparsers.add_parser("signals", help="Spearman rho of per-token signals against occlusion importance labels")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", required=True)
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="task option")
    p.add_argument("--limit", type=int, default=30, help="samples")
    p.add_argument("--sample-seed", type=int, default=0)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="answer tokens at most (the scored tokens, as in kvleague fidelity); with --trace self, exactly",
    )
    p.add_argument(
        "--trace",
        default="reference",
        choices=TRACES,
        help="the answer: the task's reference continuation, the model's own greedy continuation (to EOS), "
        "or self: its own greedy full-cache trace of exactly --max-tokens tokens after the prompt, "
        "special tokens suppressed (runner.fidelity.self_traces, the paper's regime)",
    )
    p.add_argument(
        "--occlude",
        default="context",
        choices=OCCLUDED,
        help="where the windows slide: over the context before the answer, prompt included (default), or "
        "over the answer's trace only, each window scored on the trace tokens after it (the EpiKV "
        "authors' setting; the prompt is never occluded)",
    )
    p.add_argument("--trace-batch", type=int, default=8, help="with --trace self: prompts decoded together")
    p.add_argument("--window", type=int, default=32, help="occlusion window (tokens)")
    p.add_argument("--stride", type=int, default=16, help="occlusion stride (tokens)")
    p.add_argument("--rolling", type=int, default=64, help="trailing window of the smoothed hidden-state change")
    p.add_argument(
        "--flip-label", action="store_true", help="also the authors' answer-flip label (greedy regeneration per window)"
    )
    p.add_argument("--flip-tokens", type=int, default=64, help="answer tokens generated for the flip label")
    p.add_argument(
        "--method", action="append", default=None, help="methods whose scores to study (default: every registered one)"
    )
    p.add_argument(
        "--score-budget-fraction",
        type=float,
        default=0.5,
        help="CacheView.budget handed to score, as a fraction of the cache",
    )
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the samples")
    p.add_argument(
        "--all-intervals",
        action="store_true",
        help="bootstrap intervals for every signal (default: the smoothed hidden-state change per layer, "
        "the all-layer signals and the methods; the other per-layer signals get rho and p only)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="take no new sample after this many seconds; samples run in a seeded random order, so those "
        "studied are a uniform random subset",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the methods and of the bootstrap")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--data-dir", default=None)
    p.add_argument(
        "--json", default=None, metavar="FILE", help="write the per-sample labels and the correlations to FILE"
    )
    p.add_argument(
        "--db", default=None, metavar="URL", help="database URL (default: $KVLEAGUE_DB or sqlite:///kvleague.db)"
    )
    p.add_argument("--no-store", action="store_true", help="do not write the database")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvleague.runner.signals.study import SignalOptions

    options = SignalOptions(
        window=args.window,
        stride=args.stride,
        rolling=args.rolling,
        max_tokens=args.max_tokens,
        trace=args.trace,
        occluded=args.occlude,
        flip_label=args.flip_label,
        flip_tokens=args.flip_tokens,
        score_budget_fraction=args.score_budget_fraction,
        seed=args.seed,
    )
    options.check()
    if args.trace_batch < 1:
        raise KvleagueError(f"trace-batch: must be a positive integer, got {args.trace_batch}")
    if args.limit < 1:
        raise KvleagueError(f"limit: must be a positive integer, got {args.limit}")
    if args.bootstrap < 100:
        raise KvleagueError(f"bootstrap: must be at least 100 resamples, got {args.bootstrap}")
    if args.max_seconds is not None and args.max_seconds <= 0:
        raise KvleagueError(f"max-seconds: must be positive, got {args.max_seconds}")

    import numpy as np
    import torch

    from kvleague.analysis.signal_tables import headline  # the signals with intervals (an interval costs a bootstrap)
    from kvleague.methods.registry import available_methods, build_method
    from kvleague.runner.fidelity import prompt_ids, self_traces
    from kvleague.runner.models import load_engine
    from kvleague.runner.provenance import collect_environment
    from kvleague.runner.reference_tasks import load_samples, reference_task, write_report
    from kvleague.runner.signals.correlation import SampleBootstrap
    from kvleague.runner.signals.study import LABELS, filler_token, study_sample

    if args.threads:
        torch.set_num_threads(args.threads)
    task = reference_task(args.task, args.option, "to occlude against")
    names = list(dict.fromkeys(args.method or available_methods()))
    methods = {name: build_method(name, {}) for name in names}
    engine = load_engine(args.model, attn_implementation="eager", dtype=args.dtype)
    samples = load_samples(task, engine.tokenizer, args.limit, args.sample_seed, args.data_dir)
    random.Random(args.sample_seed).shuffle(samples)  # any prefix is a uniform random subset (--max-seconds)
    config = {
        "model": args.model,
        "task": args.task,
        "domain": task.domain,
        "task_options": task.option_values(),
        "limit": args.limit,
        "sample_seed": args.sample_seed,
        "options": dataclasses.asdict(options),
        "filler_token": filler_token(engine.tokenizer),
        "methods": {n: m.params() for n, m in methods.items()},
        "bootstrap": args.bootstrap,
        "bootstrap_seed": args.seed,
        "n_layers": engine.n_layers,
        "attn_implementation": "eager",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }
    run_id = uuid.uuid4().hex
    studied = []
    per_sample: list[dict] = []
    start = time.perf_counter()
    traces: dict[int, list[int]] = {}  # --trace self: sample index -> its trace, decoded --trace-batch at a time
    for i, sample in enumerate(samples):
        if args.max_seconds is not None and time.perf_counter() - start > args.max_seconds:
            print(
                f"[{args.task}] --max-seconds {args.max_seconds:.0f} reached: {i} of {len(samples)} samples studied",
                file=sys.stderr,
                flush=True,
            )
            break
        if options.trace == "self" and i not in traces:
            batch = range(i, min(i + args.trace_batch, len(samples)))
            prompts = [prompt_ids(task.fidelity_segments(samples[j], engine.tokenizer)) for j in batch]
            t0 = time.perf_counter()
            traces.update(zip(batch, self_traces(engine, prompts, options.max_tokens)))
            print(
                f"[{args.task}] self traces of samples {batch.start + 1}-{batch.stop}: {time.perf_counter() - t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )
        s = study_sample(engine, task, sample, methods, options, traces.pop(i, None))
        studied.append(s)
        per_sample.append(s.to_dict())
        print(
            f"[{args.task}] {i + 1}/{len(samples)} {sample.sample_id}: {s.context_tokens} context tokens, "
            f"{s.studied_tokens} studied, {len(s.windows)} windows, {time.perf_counter() - start:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        if args.json:  # after every sample, so an interrupted run keeps its labels
            write_report(args.json, {"run_id": run_id, "config": config, "samples": per_sample, "correlations": []})

    correlations = []
    for label in LABELS:
        mine = [s for s in studied if label in s.labels]
        if not mine:
            continue
        boot = SampleBootstrap([s.labels[label] for s in mine], args.bootstrap, args.seed)
        signals = list(dict.fromkeys(name for s in mine for name in s.signals))
        position = [np.arange(s.studied_tokens, dtype=np.float64) for s in mine]  # the index in the occluded span
        for name in signals:
            values = [s.signals.get(name, _missing(s.studied_tokens)) for s in mine]
            shown = headline(name)
            c = boot.correlate(values, interval=args.all_intervals or shown)
            row = {"label": label, "signal": name, **dataclasses.asdict(c)}
            if shown and name != POSITION:  # the headline signals with position held fixed
                pc = boot.partial(values, position)
                row.update(
                    control=POSITION, partial_rho=pc.rho, partial_lo=pc.lo, partial_hi=pc.hi, partial_p_value=pc.p_value
                )
            correlations.append(row)
    config["sample_ids"] = [s.sample_id for s in studied]
    config["samples_requested"] = len(samples)
    config["max_seconds"] = args.max_seconds
    config["wall_seconds"] = time.perf_counter() - start
    report = {
        "run_id": run_id,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "config": config,
        "environment": collect_environment(),
        "samples": per_sample,
        "correlations": correlations,
    }
    if args.json:
        write_report(args.json, report)
    if not args.no_store:
        from kvleague.db.session import default_url, display_url
        from kvleague.runner.signals.store import store_correlations

        n = store_correlations(report, args.db)
        print(
            f"stored {n} correlations of run {run_id[:12]} in {display_url(args.db or default_url())}", file=sys.stderr
        )
    _print_summary(correlations)
    return 0


def _missing(n: int):
    import numpy as np

    return np.full(n, np.nan)


#: the key under the summary: what each column is
SUMMARY_KEY = (
    "rho: Spearman's rho of the signal against the label, pooled over every token of every sample; "
    "[lo, hi]: its 95% bootstrap interval over samples; 'position fixed': the partial rho with the token's "
    "place in the span held fixed; n: samples; pairs: tokens"
)
#: below this many samples a bootstrap over samples understates the uncertainty (few distinct resamples)
FEW_SAMPLES = 10


def _rho(rho: float, lo: float, hi: float) -> str:
    """``rho [lo, hi]``, or words where there is too little data for one (NaN: too few samples or tokens)."""
    if rho != rho:
        return "too few samples"
    if lo != lo or hi != hi:
        return f"{rho:+.3f} [no interval: too few samples]"
    return f"{rho:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _print_summary(correlations: list[dict]) -> None:
    from kvleague.analysis.signal_tables import headline

    shown = [c for c in correlations if headline(c["signal"])]
    for c in shown:
        partial = (
            f"  | position fixed {_rho(c['partial_rho'], c['partial_lo'], c['partial_hi'])}" if "control" in c else ""
        )
        print(
            f"{c['label']:<14} {c['signal']:<32} rho {_rho(c['rho'], c['lo'], c['hi'])}{partial}  "
            f"n={c['n_samples']} pairs={c['n_pairs']}"
        )
    if shown:
        print(f"key: {SUMMARY_KEY}")
        n = min(c["n_samples"] for c in shown)
        if n < FEW_SAMPLES:
            print(
                f"note: n={n} samples: a bootstrap over so few samples has few distinct resamples and its "
                f"intervals are too narrow; take them as rough (at least {FEW_SAMPLES} samples for intervals to lean on)"
            )
