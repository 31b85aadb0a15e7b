"""Feasible context: the longest prompt each method handles under a memory cap.

For every method, the longest prompt (cap first, then doubling, then bisection; see
:func:`runner.bench.harness.search_limit`) whose prefill + scoring + ``--decode-steps`` decode
steps keeps the process's **peak memory** under ``--memory-gib``. Each probe runs in a fresh
subprocess, because on Linux a process's RSS high-water mark cannot be reset from inside it; the
parent reads the child's peak from ``wait4`` (``ru_maxrss``), which is the kernel's own
accounting, not a formula. While it runs, the parent watches the child's RSS and stops it as soon
as it passes the cap (the probe then does not fit), so an over-large probe cannot exhaust the
machine. On a GPU the child reports ``torch.cuda.max_memory_allocated`` instead, and the cap
applies to that.

The model runs under the attention kernel each method requires (``h2o``: eager, so the prefill
materialises the attention matrix; the others: SDPA). Attention-free methods (``epikv``,
``lag_kv``, ``knorm``, ``streaming_llm``) prefill in chunks of ``--prefill-chunk`` tokens and
compress after each chunk, so their cache never holds more than budget + chunk entries;
attention-based ones (``h2o``, ``snapkv``, ``tova``) score the whole prompt at once, as their papers
do (``--chunk-attention-based`` chunks them too). The search is capped at ``--max-tokens`` (CPU
prefill time grows with the prompt): a method that fits the cap is reported as ">= cap". A probe
that outlives ``--probe-timeout`` counts as not fitting and is marked so.

Reported: max tokens per method, and the ratio of each attention-free method to each attention-based
one (the EpiKV paper claims 16x for epikv against attention-based scoring).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvleague.analysis import paper

ATTENTION_FREE = ("epikv", "lag_kv", "knorm", "streaming_llm")
ATTENTION_BASED = ("h2o", "snapkv", "tova")
PROBE_MARK = "KVLEAGUE_PROBE "
GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", nargs="+", help=f"default: {' '.join(ATTENTION_FREE + ATTENTION_BASED)}")
    p.add_argument(
        "--memory-gib", type=float, default=None, help="peak-memory cap (default: 4 on CPU; on a GPU its memory)"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="search cap (default 16384; quick 4096)")
    p.add_argument("--start", type=int, default=1024, help="first size of the doubling phase")
    p.add_argument(
        "--resolution", type=int, default=64, help="bisection stops when the bracket is this narrow (tokens) ..."
    )
    p.add_argument("--relative", type=float, default=0.05, help="... or this fraction of the fitting size")
    p.add_argument("--budget", type=int, default=1024, help="KV budget of every method")
    p.add_argument("--prefill-chunk", type=int, default=512, help="chunk size of attention-free prefill")
    p.add_argument("--chunk-attention-based", action="store_true", help="chunk attention-based prefill too")
    p.add_argument(
        "--attention-based-impl",
        choices=["required", "eager"],
        default="required",
        help="kernel for attention-based methods: what they require (default), or eager for all of them",
    )
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--probe-timeout", type=float, default=900.0, help="seconds before a probe is stopped")
    p.add_argument("--threads", type=int, help="torch threads in each probe (default: torch's default)")


def method_protocol(name: str, args) -> dict:
    chunked = name not in ATTENTION_BASED or args.chunk_attention_based
    return {"prefill_chunk": args.prefill_chunk if chunked else None}


# -- the probe (child process) -------------------------------------------------------------------


def _status_kib(pid: int | str, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_probe(spec: dict) -> dict:
    """Load the model, prefill ``spec['tokens']`` random tokens, decode; report what happened."""
    import torch

    from kvleague.engine.protocol import GenerationSettings, Protocol
    from kvleague.methods import build_method
    from kvleague.runner.bench.harness import random_prompt
    from kvleague.runner.models import load_engine

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    out = {"tokens": spec["tokens"], "ok": False}
    engine = load_engine(spec["model"], attn_implementation=spec.get("attn_implementation", "sdpa"))
    engine.eos_ids = set()
    cuda = engine.device.type == "cuda"
    out["rss_loaded_bytes"] = _status_kib("self", "VmRSS") * 1024
    prompt = random_prompt(spec["tokens"], seed=spec.get("seed", 0))
    method = build_method(spec["method"], spec.get("params") or {})
    protocol = Protocol(prefill_chunk=spec.get("prefill_chunk"))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        out["cuda_loaded_bytes"] = torch.cuda.memory_allocated()
    start = time.perf_counter()
    try:
        result = engine.generate(
            prompt, method, spec["budget"], protocol, GenerationSettings(max_new_tokens=spec["decode_steps"])
        )
    except (RuntimeError, MemoryError) as exc:  # allocation failures: the probe does not fit
        out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        out["out_of_memory"] = "memory" in str(exc).lower() or isinstance(exc, MemoryError)
        return out
    out.update(
        ok=True,
        seconds=time.perf_counter() - start,
        prefill_seconds=result.prefill_seconds,
        generated_tokens=result.generated_tokens,
        peak_cache_entries=result.peak_cache_entries,
        attn_implementation=result.attn_implementation,
    )
    if cuda:
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    out["vmhwm_bytes"] = _status_kib("self", "VmHWM") * 1024
    return out


def probe_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        out = run_probe(spec)
    except Exception as exc:  # anything else: report it, the parent decides
        out = {"tokens": spec.get("tokens"), "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    sys.stdout.write(PROBE_MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


# -- the parent: one subprocess per probe ---------------------------------------------------------


def measure_in_subprocess(spec: dict, cap_bytes: int, timeout: float, poll: float = 0.02) -> dict:
    """Run one probe in a fresh interpreter; return its report plus ``peak_bytes`` and ``fits``.

    The peak is ``ru_maxrss`` of the child from ``wait4`` (its whole life: imports, model load,
    prefill, decode). The child is killed once its RSS passes ``cap_bytes`` or it outlives ``timeout``."""
    cmd = [sys.executable, "-m", "kvleague.runner.bench.feasible_context", "--probe", json.dumps(spec)]
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, env=env)
        start, killed, peak_seen = time.perf_counter(), None, 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            rss = _status_kib(proc.pid, "VmRSS") * 1024
            peak_seen = max(peak_seen, rss)
            if killed is None and rss > cap_bytes:
                killed = "memory"
                os.kill(proc.pid, signal.SIGKILL)
            elif killed is None and time.perf_counter() - start > timeout:
                killed = "time"
                os.kill(proc.pid, signal.SIGKILL)
            time.sleep(poll)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_file.seek(0)
        lines = [l for l in out_file.read().splitlines() if l.startswith(PROBE_MARK)]
        err_file.seek(0)
        stderr_tail = err_file.read()[-800:]
    report: dict[str, Any] = json.loads(lines[-1][len(PROBE_MARK) :]) if lines else {"ok": False}
    report["peak_rss_bytes"] = max(usage.ru_maxrss * 1024, peak_seen)  # ru_maxrss is in KiB on Linux
    report["wall_seconds"] = time.perf_counter() - start
    report["exit_code"] = proc.returncode
    if killed:
        report["killed"] = killed
    if not report.get("ok") and not killed and not report.get("error"):
        report["error"] = (
            f"exit code {proc.returncode}: {stderr_tail.strip().splitlines()[-1] if stderr_tail.strip() else ''}"
        )
    peak = report.get("cuda_peak_bytes", report["peak_rss_bytes"])
    report["peak_bytes"] = peak
    report["fits"] = bool(report.get("ok")) and peak <= cap_bytes
    return report


def _bound(failing, cap: int) -> str:
    """Why the first size past the limit failed: memory, time, or an error that is neither."""
    if failing is None:
        return "memory"
    d = failing.detail
    if d.get("killed") == "time":
        return "time"
    if d.get("killed") == "memory" or d.get("out_of_memory") or (d.get("ok") and d.get("peak_bytes", 0) > cap):
        return "memory"
    return "error"


def cap_bytes_for(args) -> tuple[int, str]:
    import torch

    if args.memory_gib is not None:
        return int(args.memory_gib * GIB), ("cuda_max_allocated" if torch.cuda.is_available() else "rss_high_water")
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "cuda_max_allocated"
    return 4 * GIB, "rss_high_water"


def run(args) -> dict:
    from kvleague.runner.bench import harness as h

    started = time.perf_counter()
    methods = args.methods or list(ATTENTION_FREE + ATTENTION_BASED)
    max_tokens = args.max_tokens or (4096 if args.quick else 16384)
    cap, source = cap_bytes_for(args)
    model = str(args.model or h.default_model())
    env = h.environment()
    print(
        f"feasible context: model {model}, cap {cap / GIB:.2f} GiB ({source}), budget {args.budget}, "
        f"prompt search up to {max_tokens} tokens, {args.decode_steps} decode steps\n{h.describe_environment(env)}",
        flush=True,
    )
    rows = []
    for name in methods:
        protocol = method_protocol(name, args)
        impl = "eager" if (name in ATTENTION_BASED and args.attention_based_impl == "eager") else "sdpa"

        def probe(tokens: int, name=name, protocol=protocol, impl=impl):
            spec = {
                "model": model,
                "method": name,
                "tokens": tokens,
                "budget": args.budget,
                "decode_steps": args.decode_steps,
                "attn_implementation": impl,
                "threads": args.threads,
                **protocol,
            }
            r = measure_in_subprocess(spec, cap, args.probe_timeout)
            why = (
                "fits" if r["fits"] else (r.get("killed") or ("over cap" if r.get("ok") else r.get("error", "failed")))
            )
            print(
                f"  {name:14s} {tokens:7d} tokens: peak {r['peak_bytes'] / GIB:6.2f} GiB, {r['wall_seconds']:6.1f} s  {why}",
                flush=True,
            )
            keep = (
                "ok",
                "peak_bytes",
                "peak_rss_bytes",
                "rss_loaded_bytes",
                "wall_seconds",
                "prefill_seconds",
                "killed",
                "error",
                "out_of_memory",
                "attn_implementation",
                "peak_cache_entries",
            )
            return r["fits"], {k: r[k] for k in keep if k in r}

        result = h.search_limit(
            probe, start=min(args.start, max_tokens), cap=max_tokens, resolution=args.resolution, relative=args.relative
        )
        failing = next((p for p in result.probes if p.size == result.upper and not p.fits), None)
        bound = "token_cap" if result.capped else _bound(failing, cap)
        fitting = [p for p in result.probes if p.fits and p.size == result.limit]
        rows.append(
            {
                "method": name,
                "family": "attention_free"
                if name in ATTENTION_FREE
                else "attention_based"
                if name in ATTENTION_BASED
                else "other",
                "max_tokens": result.limit,
                "at_least": result.capped,
                "first_failing": result.upper,
                "bound": bound,
                "attn_implementation": next(
                    (p.detail["attn_implementation"] for p in result.probes if p.detail.get("attn_implementation")),
                    impl,
                ),
                "prefill_chunk": protocol["prefill_chunk"],
                "peak_gib_at_max": fitting[0].detail["peak_bytes"] / GIB if fitting else None,
                "probes": [{"tokens": p.size, "fits": p.fits, **p.detail} for p in result.probes],
            }
        )
    ratios = []
    for free in [r for r in rows if r["family"] == "attention_free"]:
        for based in [r for r in rows if r["family"] == "attention_based"]:
            value = h.ratio(free["max_tokens"], based["max_tokens"]) if based["max_tokens"] else None
            ratios.append(
                {
                    "numerator": free["method"],
                    "denominator": based["method"],
                    "ratio": value,
                    "at_least": free["at_least"] and not based["at_least"],
                    "undetermined": based["at_least"],
                }
            )
    figures = []
    for r in rows:
        figures.append(
            h.figure(
                "max_tokens",
                r["max_tokens"],
                "tokens",
                method=r["method"],
                budget=args.budget,
                at_least=r["at_least"],
                bound=r["bound"],
                attn_implementation=r["attn_implementation"],
                prefill_chunk=r["prefill_chunk"],
                memory_cap_bytes=cap,
                memory_source=source,
            )
        )
    for q in ratios:
        figures.append(
            h.figure(
                "feasible_context_ratio",
                q["ratio"],
                "x",
                method=q["numerator"],
                budget=args.budget,
                reference=q["denominator"],
                at_least=q["at_least"],
                undetermined=q["undetermined"],
                paper_claim=paper.CONTEXT_VS_ATTENTION if q["numerator"] == paper.REFERENCE_METHOD else None,
            )
        )
    config = {
        "model": model,
        "memory_cap_bytes": cap,
        "memory_source": source,
        "max_tokens": max_tokens,
        "start": args.start,
        "resolution": args.resolution,
        "relative": args.relative,
        "budget": args.budget,
        "prefill_chunk": args.prefill_chunk,
        "chunk_attention_based": args.chunk_attention_based,
        "attention_based_impl": args.attention_based_impl,
        "decode_steps": args.decode_steps,
        "probe_timeout": args.probe_timeout,
        "threads": args.threads,
        "quick": args.quick,
    }
    summary = {"ratios": ratios, "paper_claim_epikv_over_attention_based": paper.CONTEXT_VS_ATTENTION}
    report = h.make_report(
        "feasible_context", config=config, rows=rows, figures=figures, summary=summary, env=env, started=started
    )
    print_report(report)
    return report


def print_report(report: dict) -> None:
    from kvleague.runner.bench import harness as h

    rows = [{**r, "max": f"{'>=' if r['at_least'] else ''}{r['max_tokens']}"} for r in report["rows"]]
    print("\nfeasible context (longest prompt under the memory cap)")
    print(
        h.table(
            rows,
            [
                ("method", "method", ""),
                ("family", "family", ""),
                ("attn_implementation", "attention", ""),
                ("prefill_chunk", "chunk", ""),
                ("max", "max tokens", ""),
                ("first_failing", "fails at", ""),
                ("bound", "bound", ""),
                ("peak_gib_at_max", "peak GiB", ".2f"),
            ],
        )
    )
    ratios = report["summary"]["ratios"]
    if ratios:
        print("\nratio attention-free / attention-based (paper: 16x for epikv)")
        for q in ratios:
            value = (
                "undetermined (both reached the cap)"
                if q["undetermined"]
                else (f"{'>= ' if q['at_least'] else ''}{q['ratio']:.1f}x" if q["ratio"] is not None else "-")
            )
            print(f"  {q['numerator']:14s} / {q['denominator']:8s} {value}")


def main(argv: list[str] | None = None) -> dict | None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--probe"]:
        sys.exit(probe_main(argv[1]))
    from kvleague.runner.bench.cli import run_script

    return run_script(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
