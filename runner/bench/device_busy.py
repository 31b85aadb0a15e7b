"""How busy the device is while the engine decodes: ``torch.profiler`` over steady-state decode steps.

The GPU issue's diagnosis was a profile: the device worked ~7% of each decode step, the rest was
the host dispatching kernels one at a time. This benchmark measures that per method, batch size and
backend (``--backend hf --backend slab`` side by side): a batch of random prompts is prefilled, then
decoded under the profiler (CPU activity, and CUDA where there is a GPU); each
``DecodeLoop.step`` is marked, the profiler starts after the first ``--warmup`` steps (where a run's
CUDA graph is captured and kernels are first used, unprofiled), and over the window from the next
step's start to the last one's end it reports

* ``device_busy``: the union of the device's kernel and copy intervals / the window's wall time
  (1.0: the device never waits for the host; **not measured** without CUDA);
* ``kernels_per_token``: device kernels and copies per generated token (a replayed CUDA graph's
  kernels count one by one; what it saves is their launches, in ``host_ops_per_step``);
* ``host_ops_per_step``: ATen ops the host dispatched per step, outermost only (an op that a
  replayed graph runs is not dispatched);
* ``step_ms``: wall milliseconds per step (the profiler's own overhead included: compare backends and
  methods within one run, not with ``bench batch``'s tokens/s).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvleague.runner.bench.cli import add_backend

MARK = "kvleague::decode_step"

#: the printed table's columns: (field, header, format)
COLUMNS = [
    ("method", "method", ""),
    ("batch_size", "batch", "d"),
    ("device_busy", "device busy", ".3f"),
    ("kernels_per_token", "kernels/token", ".1f"),
    ("host_ops_per_step", "host ops/step", ".1f"),
    ("step_ms", "ms/step", ".2f"),
]
#: one line per column of the printed table
KEY = {
    "batch": "sequences decoded together",
    "device busy": "the share of the profiled steps' wall time some kernel or copy ran on the device (CUDA only)",
    "kernels/token": "device kernels and copies per generated token (CUDA only)",
    "host ops/step": "host-side operator calls per decode step",
    "ms/step": "wall milliseconds per decode step, the profiler's overhead included",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_backend(p)
    p.add_argument("--methods", default="full,epikv", help="comma-separated (default full,epikv)")
    p.add_argument("--batch-sizes", help="comma-separated (default 1,32; quick: 1,4)")
    p.add_argument("--prompt-tokens", type=int, help="default 400 (quick: 64)")
    p.add_argument("--budget", type=int, help="default 200 (quick: 32)")
    p.add_argument("--steps", type=int, help="decode steps profiled (default 32; quick: 8)")
    p.add_argument("--warmup", type=int, default=4, help="decode steps before the profiled ones (default 4)")


@contextmanager
def marked_steps(prof, start_at: int) -> Iterator[list[int]]:
    """Every ``DecodeLoop.step`` inside a profiler range named :data:`MARK`, ``prof`` started just
    before step ``start_at`` (0-based): the steps before it, a CUDA graph's capture among them, run
    unprofiled. Yields the count of steps run."""
    from torch.profiler import record_function

    from kvleague.engine.decode import DecodeLoop

    step, count = DecodeLoop.step, [0]

    def marked(self, token_ids):
        if count[0] == start_at:
            prof.start()
        count[0] += 1
        with record_function(MARK):
            return step(self, token_ids)

    DecodeLoop.step = marked
    try:
        yield count
    finally:
        DecodeLoop.step = step
        if count[0] > start_at:
            prof.stop()


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def analyse(events, batch: int, warmup: int) -> dict:
    """The window's figures from the profiler's events (see the module docstring)."""
    from torch.profiler import DeviceType

    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == MARK)
    measured = steps[warmup:]
    if not measured:
        return {"steps": 0}
    start, end = measured[0][0], measured[-1][1]
    inside = [e for e in events if start <= e.time_range.start and e.time_range.end <= end]
    device = [(e.time_range.start, e.time_range.end) for e in inside if e.device_type == DeviceType.CUDA]
    host_ops = [
        e
        for e in inside
        if e.device_type == DeviceType.CPU
        and e.name.startswith("aten::")
        and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
    ]
    n = len(measured)
    cuda = any(e.device_type == DeviceType.CUDA for e in events)
    return {
        "steps": n,
        "device_busy": union_length(device) / (end - start) if cuda else None,
        "kernels_per_token": len(device) / (n * batch) if cuda else None,
        "host_ops_per_step": len(host_ops) / n,
        "step_ms": (end - start) / n / 1e3,
    }


@contextmanager
def profiler_lines_dropped() -> Iterator[None]:
    """torch's profiler (kineto, in C++) writes "USDT:" and "STAGE:" lines to file descriptor 2 at each
    start and stop, whatever its log level; they say nothing about the run. What reaches fd 2 meanwhile
    is held and written back without them."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(("USDT:", "STAGE:")):
                    sys.stderr.write(line)
            sys.stderr.flush()


def measure(engine, method: str, batch: int, budget: int, prompt_tokens: int, steps: int, warmup: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvleague.engine.protocol import GenerationSettings, Protocol
    from kvleague.methods import build_method
    from kvleague.runner.bench import harness as h

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    prompts = [h.random_prompt(prompt_tokens, seed=i) for i in range(batch)]
    settings = GenerationSettings(max_new_tokens=warmup + steps + 1)  # the first token comes from the prefill
    prof = profile(activities=activities)
    with profiler_lines_dropped(), marked_steps(prof, warmup) as count:
        engine.generate_batch(
            prompts, [build_method(method) for _ in prompts], budget, Protocol(), settings, batch_size=batch
        )
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    return {
        "method": method,
        "batch_size": batch,
        **(analyse(prof.events(), batch, 0) if count[0] > warmup else {"steps": 0}),
    }


def run(args) -> dict:
    """The benchmark on each ``--backend`` in turn (``harness.across_backends``)."""
    from kvleague.runner.bench import harness as h

    return h.across_backends(args, run_one)


def run_one(args) -> dict:
    from kvleague.runner.bench import harness as h

    started = time.perf_counter()
    quick = getattr(args, "quick", False)
    for name, default, small in (
        ("batch_sizes", "1,32", "1,4"),
        ("prompt_tokens", 400, 64),
        ("budget", 200, 32),
        ("steps", 32, 8),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else default)
    methods = [m for m in args.methods.split(",") if m]
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    source, engine, label = h.bench_engine(args)
    env = h.environment()
    print(
        f"device busy: {label}; prompt {args.prompt_tokens}, B = {args.budget}, {args.steps} steps after {args.warmup}, "
        f"batch sizes {sizes}, methods {methods}\n{h.describe_environment(env)}",
        flush=True,
    )
    rows = [
        measure(engine, m, b, args.budget, args.prompt_tokens, args.steps, args.warmup) for m in methods for b in sizes
    ]
    common = dict(prompt_tokens=args.prompt_tokens, new_tokens=args.steps, budget=args.budget)
    figures = [
        h.figure(metric, row[metric], unit, method=row["method"], batch_size=row["batch_size"], **common)
        for row in rows
        for metric, unit in (
            ("device_busy", "fraction"),
            ("kernels_per_token", "kernels"),
            ("host_ops_per_step", "ops"),
            ("step_ms", "ms"),
        )
    ]
    config = {
        "model": source,
        "model_label": label,
        "prompt_tokens": args.prompt_tokens,
        "budget": args.budget,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_sizes": sizes,
        "methods": methods,
        "quick": quick,
    }
    report = h.make_report(
        "device_busy",
        config=config,
        rows=rows,
        figures=figures,
        summary={"engine": engine.describe()},
        env=env,
        started=started,
    )
    print(
        h.table(
            rows,
            COLUMNS,
            KEY,
        )
    )
    return report


def main(argv: list[str] | None = None) -> dict:
    from kvleague.runner.bench.cli import run_script

    return run_script(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
