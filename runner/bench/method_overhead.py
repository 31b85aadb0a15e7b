"""Per-decode-step cost of each eviction method's scoring + selection, at cache budgets 256 / 1024 / 4096.

For every budget B, each method runs one sequence on the same model: a random B-token prompt, then
greedy decode steps with the cache held at B (so every step scores a full cache). Per fed decode
step it reports, in milliseconds:

* ``observe``  the method's ``observe()`` (its per-token bookkeeping),
* ``score``    the method's ``score()``,
* ``select``   the engine's protection + top-k + physical gather of the cache,
* ``method``   observe + score + select (what ``GenerationResult.method_seconds`` counts),
* ``decode``   the backend's forward pass plus observe, score and select (sampling excluded),

``overhead`` = method / (decode step of ``full`` at the same B) and ``step x`` = decode / full
decode step. ``full`` (no eviction) runs first and last for each budget, side by side in the same
process, and the mean of the two is the baseline. Each method runs under the cadence its paper uses
(``buffer=128`` for ``snapkv`` and ``rkv``: their cost is amortised over 128 + 1 steps, including
one compression; every step for the others) and under the attention kernel it needs (``h2o``: eager).

The default clock is the process CPU time with one torch thread: on a shared machine, wall time
mostly measures the other tenants; CPU time of a single-threaded run does not (``--clock wall`` for
wall time with torch's default threads).

    python -m runner.bench.method_overhead [--quick] [--budgets 256 1024 4096] [--methods epikv h2o ...]
                                           [--clock cpu|wall] [--json method_overhead.json]

The default run (8 layers, hidden 768: 41M parameters; 3 budgets; every registered method) takes
about 10 minutes on an idle 2-core machine; ``--quick`` (budgets 256 and 1024, 16 steps, buffer
methods at ``buffer=16``) about 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from kvleague.engine import Engine
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import available_methods, build_method
from kvleague.runner.models import load_engine
from kvleague.runner.models.tiny import make_tiny_model

#: the paper cadence of methods that compress every N steps rather than every step
BUFFERED = {"snapkv": 128, "rkv": 128}


def measure(engine: Engine, name: str, budget: int, prompt: list[int], steps: int, buffer: int | None, clock) -> dict:
    method = build_method(name)
    timers = {"observe": 0.0, "score": 0.0, "select": 0.0, "model": 0.0}

    def timed(key, fn):
        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[key] += clock() - start

        return wrapper

    method.observe = timed("observe", method.observe)
    method.score = timed("score", method.score)
    cadence = f"buffer={buffer}" if buffer else "every_step"
    protocol = Protocol(cadence=cadence, prefill_chunk=512)
    n_steps = steps + buffer + 1 if buffer else steps  # buffered: include exactly one compression
    with engine.session(method, budget, protocol) as session:
        start = time.perf_counter()
        session.feed(prompt)
        prefill = time.perf_counter() - start
        # from here on: the backend's forward pass and the engine's selection (on the instances only)
        backend = engine.backend
        backend.forward = timed("model", backend.forward)
        session.apply_scores = timed("select", session.apply_scores)
        for key in timers:
            timers[key] = 0.0
        evictions0 = session.evictions
        session.decode(GenerationSettings(max_new_tokens=n_steps + 1))  # n_steps fed forward passes
        evictions = session.evictions - evictions0
        attn = session.attn_implementation
        del backend.forward  # the class's own again
    ms = lambda seconds: 1000.0 * seconds / n_steps  # noqa: E731
    return {
        "method": name,
        "budget": budget,
        "cadence": cadence,
        "attn_implementation": attn,
        "steps": n_steps,
        "evictions": evictions,
        "prefill_s": prefill,
        "observe_ms": ms(timers["observe"]),
        "score_ms": ms(timers["score"]),
        "select_ms": ms(timers["select"]),
        "method_ms": ms(timers["observe"] + timers["score"] + timers["select"]),
        "decode_ms": ms(timers["model"] + timers["observe"] + timers["score"] + timers["select"]),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="budgets 256 1024, 16 steps, buffer methods at buffer=16")
    parser.add_argument("--budgets", type=int, nargs="+")
    parser.add_argument("--methods", nargs="+", help="default: every registered method")
    parser.add_argument("--steps", type=int, help="fed decode steps per every-step method (default 32; quick 16)")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--model", help="checkpoint dir (default: build a random-weight model offline)")
    parser.add_argument("--json", default="method_overhead.json", help="write the figures here")
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu (default): process CPU time with 1 torch thread, robust to other load on the machine; wall: perf_counter",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: 1 with --clock cpu, else torch's default)")
    args = parser.parse_args(argv)

    if args.threads or args.clock == "cpu":
        torch.set_num_threads(args.threads or 1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    budgets = args.budgets or ([256, 1024] if args.quick else [256, 1024, 4096])
    steps = args.steps or (16 if args.quick else 32)
    names = [n for n in (args.methods or available_methods()) if n != "full"]
    model = args.model or str(
        make_tiny_model(
            args.arch,
            tempfile.mkdtemp(),
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
        )
    )
    engine = load_engine(model)
    engine.eos_ids = set()  # every run decodes exactly its number of steps
    params = engine.describe()["parameters"]
    generator = torch.Generator().manual_seed(0)
    print(
        f"model: {args.arch} {params / 1e6:.1f}M params ({engine.n_layers} layers, hidden {engine.backend.hidden_size}, "
        f"{engine.n_heads} heads / {engine.n_kv_heads} KV heads), torch threads {torch.get_num_threads()}, clock {args.clock}"
    )

    rows = []
    for budget in budgets:
        prompt = torch.randint(0, 256, (budget,), generator=generator).tolist()
        # warm-up (allocator, kernels) so the first measured run is not penalised
        measure(engine, "full", budget, prompt[: min(budget, 256)], 4, None, clock)
        baseline = [measure(engine, "full", budget, prompt, steps, None, clock)]
        results = []
        for name in names:
            buffer = BUFFERED.get(name)
            if buffer and args.quick:
                buffer = 16
            results.append(measure(engine, name, budget, prompt, steps, buffer, clock))
            print(f"  B={budget:5d} {name:14s} method {results[-1]['method_ms']:8.3f} ms/step", flush=True)
        baseline.append(measure(engine, "full", budget, prompt, steps, None, clock))
        full_ms = statistics.mean(b["decode_ms"] for b in baseline)
        for r in [*results]:
            r["full_decode_ms"] = full_ms
            r["overhead"] = r["method_ms"] / full_ms
            r["step_ratio"] = r["decode_ms"] / full_ms
        rows.extend(results)
        rows.append(
            {
                **baseline[0],
                "method": "full",
                "decode_ms": full_ms,
                "full_decode_ms": full_ms,
                "overhead": 0.0,
                "step_ratio": 1.0,
            }
        )

    header = f"{'method':14s} {'B':>5s} {'cadence':>10s} {'observe':>8s} {'score':>8s} {'select':>8s} {'method':>8s} {'decode':>8s} {'overhead':>9s} {'step x':>7s}"
    print(
        f"\nper fed decode step, milliseconds ({args.clock} clock); overhead = method / full decode step at the same B"
    )
    print(header)
    print("-" * len(header))
    for r in sorted(rows, key=lambda r: (r["method"], r["budget"])):
        print(
            f"{r['method']:14s} {r['budget']:5d} {r['cadence']:>10s} {r['observe_ms']:8.3f} {r['score_ms']:8.3f} {r['select_ms']:8.3f} "
            f"{r['method_ms']:8.3f} {r['decode_ms']:8.2f} {100 * r['overhead']:8.2f}% {r['step_ratio']:7.3f}"
        )
    figures = {
        "model": model if args.model else f"random-weight {args.arch}, {params / 1e6:.1f}M params",
        "config": {
            "layers": engine.n_layers,
            "hidden": engine.backend.hidden_size,
            "heads": engine.n_heads,
            "kv_heads": engine.n_kv_heads,
        },
        "budgets": budgets,
        "steps": steps,
        "quick": args.quick,
        "clock": args.clock,
        "rows": rows,
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
        },
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
        print(f"\nwrote {args.json}")
    return figures


if __name__ == "__main__":
    main()
