"""Engine vs ``model.generate``: decode speed with no eviction, on the same model and prompt.

Both decode the same number of greedy tokens (EOS ignored) from the same prompt. Decode time is
taken from the first generated token to the last (``model.generate`` is timed through a streamer,
the engine around its ``decode`` after the prompt is fed), so both count the same forward passes;
end-to-end time (prefill included) is reported too. Runs alternate and medians are compared; the
target is engine / generate >= 0.9.

``--static-anchor`` adds the reference a user would try first: ``model.generate`` with Hugging Face's
static cache, whose decode step transformers compiles on CUDA (``torch.compile``, mode
``reduce-overhead``: CUDA graphs); its first call, the compile, is timed apart and the alternating
rounds time the compiled step (on the CPU transformers does not compile: the static cache alone).

Before the comparison, the engine decodes once over KV lengths the process has not met and then
again over the same lengths: their ratio (target >= 0.9) shows what per-shape set-up (a kernel's
plan, an allocator's blocks) costs a decode that meets a new cache length at every step. A short
decode at disjoint lengths (at most 24) runs first, so that loading each kernel once (CUDA loads
them lazily) is not charged to new lengths.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from kvleague.runner.bench.cli import add_backend

TARGET = 0.9
FIRST_PASS_TARGET = 0.9


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_backend(p)
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 1024 (quick 256)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 512 (quick 128)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; quick 3)")
    p.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto", help="auto: cpu without CUDA, else wall")
    p.add_argument("--threads", type=int, help="torch threads (default: 1 with the cpu clock)")
    p.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let SDPA use cuDNN's kernel (the engine turns it off on CUDA: it plans per KV length)",
    )
    add_static_anchor(p)


def add_static_anchor(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--static-anchor",
        action="store_true",
        help="also time model.generate with HF's static cache (compiled by transformers on CUDA, mode "
        "reduce-overhead); its first call, the compile, is timed apart",
    )


def static_anchor(engine, run: Callable[[], dict], clock) -> tuple[Callable[[], dict] | None, dict]:
    """``model.generate`` with the static cache (``run`` with ``cache_implementation="static"``): the
    runner to alternate, and its first call's facts (seconds, whether transformers compiled the step).
    A first call that fails (a machine where ``torch.compile`` cannot build) gives no runner and the
    error's first line, so the rest of the benchmark still reports."""
    from kvleague.engine.errors import first_line

    start = clock.now()
    try:
        run()
    except Exception as exc:
        print(f"static-cache anchor failed: {first_line(exc)}", flush=True)
        return None, {"first_call_seconds": None, "compiled": False, "error": first_line(exc)}
    from kvleague.engine.anchors import compiled_by_generate

    first = {"first_call_seconds": clock.now() - start, "compiled": compiled_by_generate(engine)}
    return run, first


class StepClock:
    """A ``model.generate`` streamer that timestamps every batch of tokens it is handed."""

    def __init__(self, clock):
        self.clock, self.stamps = clock, []

    def put(self, value) -> None:
        self.stamps.append(self.clock.now())

    def end(self) -> None:
        pass

    def decode_seconds(self) -> float:
        """From the first generated token (the prompt is the first ``put``) to the last."""
        return self.stamps[-1] - self.stamps[1]


def time_generate_batch(engine, prompts: list[list[int]], new_tokens: int, clock, press=None, **kwargs) -> dict:
    """``model.generate`` on equal-length ``prompts`` as one batch (inside ``press(model)`` when given),
    timed by a streamer: decode tokens/s summed over the rows, and each row's tokens."""
    import contextlib

    import torch

    from kvleague.engine.anchors import plain_attention

    streamer = StepClock(clock)
    start = clock.now()
    with (
        plain_attention(engine) as model,
        press(model) if press is not None else contextlib.nullcontext(),
        torch.inference_mode(),
    ):
        ids = torch.tensor(prompts, device=engine.device)
        # an explicit mask: generate would otherwise take prompt tokens equal to the pad id for padding
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            streamer=streamer,
            **kwargs,
        )
    total = clock.now() - start
    decode = streamer.decode_seconds()
    return {
        "decode_tps": len(prompts) * (new_tokens - 1) / decode,
        "total_seconds": total,
        "tokens": out[:, len(prompts[0]) :].tolist(),
    }


def time_generate(engine, prompt: list[int], new_tokens: int, clock, press=None, **kwargs) -> dict:
    """:func:`time_generate_batch` of one prompt; ``tokens`` its own."""
    out = time_generate_batch(engine, [prompt], new_tokens, clock, press, **kwargs)
    return {**out, "tokens": out["tokens"][0]}


def time_engine(
    engine, prompt: list[int], new_tokens: int, clock, method: str = "full", budget: int = 1 << 40, protocol=None
) -> dict:
    from kvleague.engine.protocol import GenerationSettings
    from kvleague.methods import build_method

    start = clock.now()
    with engine.session(build_method(method), budget, protocol) as session:
        session.feed(prompt)
        first = clock.now()
        out = session.decode(GenerationSettings(max_new_tokens=new_tokens))
        end = clock.now()
    # the first token comes from the prefill logits: new_tokens - 1 forward passes were timed
    return {"decode_tps": (new_tokens - 1) / (end - first), "total_seconds": end - start, "tokens": out.token_ids}


def run(args) -> dict:
    """The benchmark on each ``--backend`` in turn (``harness.across_backends``)."""
    from kvleague.runner.bench import harness as h

    return h.across_backends(args, run_one)


def run_one(args) -> dict:
    from kvleague.runner.bench import harness as h

    started = time.perf_counter()
    clock = h.Clock(args.clock)
    args.clock = clock.kind  # "auto" resolved, as the report records it
    threads = h.set_threads(clock, args.threads)
    prompt_tokens = args.prompt_tokens or (256 if args.quick else 1024)
    new_tokens = args.new_tokens or (128 if args.quick else 512)
    rounds = args.rounds or (3 if args.quick else 5)
    source, engine, label = h.bench_engine(args)
    prompt = h.random_prompt(prompt_tokens, seed=1)
    if args.cudnn_attention:
        import torch

        torch.backends.cuda.enable_cudnn_sdp(True)
    time_engine(engine, prompt[: min(16, max(1, prompt_tokens // 2))], 8, clock)  # kernels loaded, lengths <= 24
    first_pass = time_engine(engine, prompt, new_tokens, clock)  # lengths the process has not met
    second_pass = time_engine(engine, prompt, new_tokens, clock)
    env = h.environment()
    print(
        f"engine vs model.generate: {label}; prompt {prompt_tokens}, {new_tokens} new tokens, {rounds} alternating rounds; "
        f"clock {args.clock}, {threads} thread(s)\n{h.describe_environment(env)}",
        flush=True,
    )
    runs = {
        "generate": lambda: time_generate(engine, prompt, new_tokens, clock),
        "engine": lambda: time_engine(engine, prompt, new_tokens, clock),
    }
    anchor = None
    if args.static_anchor:
        static_run, anchor = static_anchor(
            engine, lambda: time_generate(engine, prompt, new_tokens, clock, cache_implementation="static"), clock
        )
        if static_run is not None:
            runs["generate_static"] = static_run
    results = h.alternate(runs, rounds)
    rows = []
    for name, runs in results.items():
        rows.append(
            {
                "method": name,
                "decode_tokens_per_second": h.median(r["decode_tps"] for r in runs),
                "total_seconds": h.median(r["total_seconds"] for r in runs),
                "rounds": len(runs),
                "per_round_tps": [r["decode_tps"] for r in runs],
            }
        )
    gen, eng = rows[0], rows[1]
    value = h.ratio(eng["decode_tokens_per_second"], gen["decode_tokens_per_second"])
    same = results["engine"][0]["tokens"] == results["generate"][0]["tokens"]
    first_over_second = h.ratio(first_pass["decode_tps"], second_pass["decode_tps"])
    common: dict[str, Any] = dict(clock=args.clock, threads=threads, prompt_tokens=prompt_tokens, new_tokens=new_tokens)
    figures = [
        h.figure("decode_tokens_per_second", gen["decode_tokens_per_second"], "tokens/s", method="generate", **common),
        h.figure("decode_tokens_per_second", eng["decode_tokens_per_second"], "tokens/s", method="engine", **common),
        h.figure(
            "speed_ratio", value, "x", method="engine", reference="generate", target=TARGET, same_tokens=same, **common
        ),
        h.figure(
            "end_to_end_ratio",
            h.ratio(gen["total_seconds"], eng["total_seconds"]),
            "x",
            method="engine",
            reference="generate",
            **common,
        ),
        h.figure(
            "first_pass_ratio",
            first_over_second,
            "x",
            method="engine",
            reference="second pass",
            target=FIRST_PASS_TARGET,
            cudnn_attention=args.cudnn_attention,
            **common,
        ),
    ]
    if "generate_static" in results:
        assert anchor is not None  # the static run exists only with its anchor
        static = rows[2]
        same_static = results["engine"][0]["tokens"] == results["generate_static"][0]["tokens"]
        figures += [
            h.figure(
                "decode_tokens_per_second",
                static["decode_tokens_per_second"],
                "tokens/s",
                method="generate_static",
                compiled=anchor["compiled"],
                **common,
            ),
            h.figure(
                "speed_ratio",
                h.ratio(eng["decode_tokens_per_second"], static["decode_tokens_per_second"]),
                "x",
                method="engine",
                reference="generate_static",
                target=TARGET,
                same_tokens=same_static,
                compiled=anchor["compiled"],
                **common,
            ),
            h.figure(
                "static_anchor_first_call_seconds",
                anchor["first_call_seconds"],
                "s",
                method="generate_static",
                compiled=anchor["compiled"],
                **common,
            ),
        ]
    config = {
        "model": source,
        "model_label": label,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "clock": args.clock,
        "threads": threads,
        "quick": args.quick,
        "cudnn_attention": args.cudnn_attention,
        "static_anchor": args.static_anchor,
    }
    summary = {
        "ratio_engine_over_generate": value,
        "target": TARGET,
        "same_tokens": same,
        "first_pass_tps": first_pass["decode_tps"],
        "second_pass_tps": second_pass["decode_tps"],
        "first_over_second_pass": first_over_second,
        "first_pass_target": FIRST_PASS_TARGET,
        "engine": engine.describe(),
    }  # which paths the decode steps took (slab: captured or eager)
    if anchor is not None:
        summary["static_anchor"] = anchor
        if "generate_static" in results:
            anchor.update(ratio_engine_over_static=figures[-2]["value"], same_tokens=same_static)
    report = h.make_report(
        "engine_vs_generate", config=config, rows=rows, figures=figures, summary=summary, env=env, started=started
    )
    print_report(report)
    return report


def print_report(report: dict) -> None:
    from kvleague.runner.bench import harness as h

    print("\nengine vs model.generate (no eviction), decode only")
    print(
        h.table(
            report["rows"],
            [
                ("method", "runner", ""),
                ("decode_tokens_per_second", "tok/s", ".2f"),
                ("total_seconds", "end-to-end s", ".2f"),
            ],
        )
    )
    s = report["summary"]
    print(
        f"ratio engine / generate: {s['ratio_engine_over_generate']:.3f} (target >= {s['target']}); "
        f"same tokens: {s['same_tokens']}"
    )
    if "static_anchor" in s and "error" in s["static_anchor"]:
        print(f"model.generate with the static cache: failed ({s['static_anchor']['error']})")
    elif "static_anchor" in s:
        a = s["static_anchor"]
        print(
            f"ratio engine / generate with the static cache ({'compiled' if a['compiled'] else 'not compiled'}; "
            f"first call {a['first_call_seconds']:.1f} s): {a['ratio_engine_over_static']:.3f} (target >= {s['target']}); "
            f"same tokens: {a['same_tokens']}"
        )
    print(
        f"first pass over new KV lengths: {s['first_pass_tps']:.1f} tok/s, second pass: {s['second_pass_tps']:.1f} tok/s, "
        f"ratio {s['first_over_second_pass']:.3f} (target >= {s['first_pass_target']})"
    )


def main(argv: list[str] | None = None) -> dict:
    from kvleague.runner.bench.cli import run_script

    return run_script(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
